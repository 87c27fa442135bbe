"""Fail before spending: check a loaded recipe completely before any weights load.

Every problem found is collected and reported at once: the model source and its
architecture, the scheme × backend × shapes, the calibration and report data, the target
GPUs and their support matrix, a speculative draft (the same checks, and a tokenizer equal
to the model's), and whether calibration fits in this machine's memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from kiln.compiler import sources
from kiln.compiler.draft.speculation import SpeculativePlan, check_speculative
from kiln.compiler.recipe.schema import Recipe, load_recipe
from kiln.compiler.stages import output_problem
from kiln.compiler.trtllm.capacity import Plan, plan
from kiln.compiler.trtllm.rules.support import check_target
from kiln.compiler.trtllm.targets import PROFILES
from kiln.quant import calibration, schemes
from kiln.quant.memory import estimate_calibration_bytes
from kiln.quant.prequantized import convert as prequantized
from kiln.quant.prequantized.convert import PreQuantized
from kiln.quant.spec import CalibrationSpec, QuantSpec
from kiln.runtime.base.errors import RecipeError, SourceError, UsageError
from kiln.runtime.formats.model_info import ModelInfo

GIB = 1 << 30


@dataclass
class Preflight:
    """A recipe that passed every check, with what the checks learned on the way."""

    recipe: Recipe
    source: sources.SourceRef
    info: ModelInfo
    spec: QuantSpec
    calibration: CalibrationSpec
    memory: dict[str, int] = field(default_factory=dict)
    plans: dict[str, Plan] = field(default_factory=dict)
    imported: PreQuantized | None = None  # a pre-quantised AWQ/GPTQ source, converted as is
    speculative: SpeculativePlan | None = None  # the draft (or n-gram) to compile beside it


def host_memory_bytes() -> int:
    """Physical memory of this machine; the budget calibration must fit in."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def run_preflight(
    recipe: Recipe, *, check_memory: bool = True, output: Path | None = None
) -> Preflight:
    """Check everything that can be checked without loading weights; raise RecipeError.

    `check_memory=False` skips the checks of the calibration host, its memory and the output
    directory (planning needs neither); `output` is where the artifact goes when not the
    recipe's own `output`.
    """
    problems: list[str] = []
    if check_memory and (problem := output_problem(output or recipe.output_dir())) is not None:
        problems.append(recipe.problem("output", problem, "a writable directory"))
    spec = recipe.quant_spec()
    calib = recipe.calibration_spec()

    ref: sources.SourceRef | None = None
    info: ModelInfo | None = None
    try:
        ref = sources.parse_source(recipe.config.model.source, recipe.base_dir("model.source"))
        info = sources.inspect_source(ref)
        problems.extend(recipe.problem("model.source", p) for p in sources.weight_problems(ref))
    except SourceError as exc:
        # SourceError messages name the key themselves; the problem line already does.
        problems.append(recipe.problem("model.source", exc.message.removeprefix("model.source ")))
    imported: PreQuantized | None = None
    if info is not None:
        arch_problems = sources.check_architecture(info)
        problems.extend(recipe.problem("model.source", p) for p in arch_problems)
        if not arch_problems:
            imported = prequantized.detect(info.config)
    if imported is not None:
        # A published AWQ/GPTQ checkpoint: the artifact holds its scheme, converted as is.
        for p in prequantized.check_recipe(spec, imported):
            problems.append(recipe.problem(p.key, p.problem, p.allowed))
        spec = imported.to_spec()

    scheme_problems = schemes.check(spec, info)
    for p in scheme_problems:
        problems.append(recipe.problem(p.key, p.problem, p.allowed))
    if imported is None and not scheme_problems and schemes.resolve(spec).needs_calibration:
        for p in calibration.check(calib):
            problems.append(recipe.problem(p.key, p.problem, p.allowed))
    for p in calibration.check(recipe.report_spec()):
        key = p.key.replace("calibration.", "report.", 1)
        problems.append(recipe.problem(key, p.problem, p.allowed))

    deploy = recipe.deploy_spec()
    plans: dict[str, Plan] = {}
    for index, target in enumerate(recipe.config.targets):
        key = f"targets.{index}"
        if target not in PROFILES:
            problems.append(
                recipe.problem(
                    key,
                    f"unknown GPU target {target!r}",
                    "known targets: " + ", ".join(sorted(PROFILES)),
                )
            )
            continue
        target_problems = check_target(spec, target, path=recipe.config.deploy.trtllm_path)
        for p in target_problems:
            problems.append(recipe.problem(key, p.problem, p.allowed))
        if info is not None and not target_problems and not scheme_problems:
            try:
                plans[target] = plan(info, spec, PROFILES[target], deploy)
            except UsageError as exc:
                problems.append(recipe.problem("deploy", exc.message))
                continue
            if not plans[target].fits:
                problems.append(
                    recipe.problem(
                        key,
                        f"the model does not fit {target} at tp={plans[target].tp_size} "
                        f"for max_seq_len {deploy.max_seq_len}",
                        "; ".join(plans[target].suggestions) or "choose a larger GPU",
                    )
                )

    # The draft is checked like the model, its tokenizer against the model's, before any
    # calibration starts.
    speculative, draft_problems = check_speculative(recipe, ref, info)
    problems.extend(draft_problems)

    memory: dict[str, int] = {}
    if info is not None and not problems and check_memory and imported is None:
        memory = estimate_calibration_bytes(info, spec, calib)
        available = int(host_memory_bytes() * 0.9)  # leave room for the OS and the tokenizer
        if memory["total"] > available:
            problems.append(
                recipe.problem(
                    "calibration.num_samples",
                    f"calibration needs about {memory['total'] / GIB:.1f} GiB but this machine has "
                    f"{available / GIB:.1f} GiB to spare",
                    "lower calibration.num_samples or calibration.max_seq_len, "
                    "or run on a larger host",
                )
            )

    if problems:
        raise RecipeError(problems)
    assert ref is not None and info is not None  # no problems means both were resolved
    return Preflight(
        recipe=recipe,
        source=ref,
        info=info,
        spec=spec,
        calibration=calib,
        memory=memory,
        plans=plans,
        imported=imported,
        speculative=speculative,
    )


def validate_recipe(recipe_path: str | Path) -> Recipe:
    """Load and preflight a recipe without running anything (`kiln validate`)."""
    recipe = load_recipe(recipe_path)
    run_preflight(recipe)
    return recipe


def validate_recipe_plans(recipe_path: str | Path) -> dict[str, Plan]:
    """Preflight a recipe and return its per-target plans (`kiln plan`)."""
    return run_preflight(load_recipe(recipe_path), check_memory=False).plans
