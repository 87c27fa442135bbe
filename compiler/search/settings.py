"""What a search tries: the recipe's `search:` section, overridden by the command line, and
what the search refuses to run before any work. The command line's numbers are checked by
the recipe's own schema (`SearchSection`), so `--budget-hours` and `search.budget_hours`
accept the same values; an empty list is refused rather than read as "all".
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from kiln.compiler.recipe.recipe import Recipe
from kiln.compiler.recipe.schema import SearchSection
from kiln.compiler.search.space import KV_VARIANTS, SCHEMES, unknown_schemes
from kiln.compiler.stages import output_problem
from kiln.compiler.trtllm.targets import PROFILES
from kiln.runtime.base.errors import UsageError


@dataclass
class SearchSettings:
    """What to search: the `search:` section of the recipe, overridden by the command line."""

    targets: list[str] = field(default_factory=list)  # empty: the recipe's targets
    schemes: list[str] = field(default_factory=lambda: list(SCHEMES))
    kv_cache: list[str] = field(default_factory=lambda: list(KV_VARIANTS))
    mixed: bool = True
    early_stop: bool = True
    measure: bool = True  # decode speed of each candidate on this machine (kiln's runtime)
    budget_hours: float | None = None
    max_candidates: int | None = None


def _names(option: str, text: str, allowed: Iterable[str]) -> list[str]:
    """A comma-separated option's names; none at all is a usage error, not "all"."""
    names = list(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
    if not names:
        raise UsageError(
            f"{option} {text!r} names nothing: give one or more of {', '.join(allowed)} "
            f"(comma-separated), or leave {option} out for all of them"
        )
    return names


def _checked_numbers(budget_hours: float | None, max_candidates: int | None) -> None:
    """The command line's budget, checked as the recipe's search: section checks it."""
    try:
        SearchSection(budget_hours=budget_hours, max_candidates=max_candidates)
    except ValidationError as exc:
        error = exc.errors()[0]
        field_name, given = str(error["loc"][0]), error["input"]
        option = "--" + field_name.replace("_", "-")
        why = error["msg"].removeprefix("Input ")
        raise UsageError(
            f"{option} {given}: {why}, as the recipe's search.{field_name} must be"
        ) from None


def command_line_settings(
    section: SearchSection | None,
    *,
    targets: tuple[str, ...] = (),
    schemes: str | None = None,
    kv_cache: str | None = None,
    no_mixed: bool = False,
    no_early_stop: bool = False,
    no_measure: bool = False,
    budget_hours: float | None = None,
    max_candidates: int | None = None,
) -> SearchSettings:
    """The recipe's `search:` section (or its defaults) with the command line's options."""
    base = section or SearchSection()
    _checked_numbers(budget_hours, max_candidates)
    if any(not t.strip() for t in targets):
        raise UsageError(
            f"--target {next(t for t in targets if not t.strip())!r} names no GPU: give one of "
            f"{', '.join(PROFILES)}, or leave --target out for the recipe's targets"
        )
    return SearchSettings(
        targets=[t.strip() for t in targets] or list(base.targets),
        schemes=_names("--schemes", schemes, SCHEMES)
        if schemes is not None
        else list(SCHEMES if base.schemes is None else base.schemes),
        kv_cache=_names("--kv-cache", kv_cache, KV_VARIANTS)
        if kv_cache is not None
        else list(base.kv_cache),
        mixed=base.mixed and not no_mixed,
        early_stop=base.early_stop and not no_early_stop,
        measure=base.measure and not no_measure,
        budget_hours=budget_hours if budget_hours is not None else base.budget_hours,
        max_candidates=max_candidates if max_candidates is not None else base.max_candidates,
    )


def check_settings(recipe: Recipe, settings: SearchSettings) -> list[str]:
    """What the search cannot run as asked, before any work."""
    problems = []
    if recipe.config.gates is None:
        problems.append(
            "kiln search judges each candidate by the recipe's gate: add a gates: "
            "section (tasks, thresholds) to the recipe"
        )
    targets = settings.targets or list(recipe.config.targets)
    if not targets:
        problems.append(
            "kiln search prices each candidate on a GPU target: give --target T "
            "(e.g. h100-sxm) or the recipe's targets:"
        )
    unknown = [t for t in targets if t not in PROFILES]
    if unknown:
        problems.append(f"unknown GPU targets {unknown} (--target, or the recipe's targets:): "
                        f"use {', '.join(PROFILES)}")  # fmt: skip
    bad = unknown_schemes(settings.schemes)
    if bad:
        problems.append(f"unknown schemes {bad} (--schemes, or the recipe's search.schemes): "
                        f"use {', '.join(SCHEMES)}")  # fmt: skip
    bad_kv = [k for k in settings.kv_cache if k not in KV_VARIANTS]
    if bad_kv:
        problems.append(f"unknown KV cache variants {bad_kv} (--kv-cache, or the recipe's "
                        f"search.kv_cache): use {', '.join(KV_VARIANTS)}")  # fmt: skip
    for key, names, allowed in (("schemes", settings.schemes, SCHEMES),
                                ("kv_cache", settings.kv_cache, KV_VARIANTS)):  # fmt: skip
        if not names:
            problems.append(f"the recipe's search.{key} is empty, so nothing would be searched: "
                            f"name one or more of {', '.join(allowed)}, or leave it out for "
                            "all of them")  # fmt: skip
    return problems


def directory_problems(out_dir: Path) -> list[str]:
    """Why `out_dir` cannot hold a search (its candidates, artifacts, state and reports)."""
    for path in (out_dir, out_dir / "candidates", out_dir / "artifacts"):
        if (why := output_problem(path)) is not None:
            return [f"search directory: {why}; give --output a writable directory"]
    return []
