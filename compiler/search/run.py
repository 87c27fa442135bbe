"""`kiln search`: the cheapest deployment of a recipe that passes its gate, per GPU target.

Each candidate (search/space.py) is written out as a recipe that `extends:` the searched one
and replaces its quantization section, then compiled and gated exactly as `kiln compile`
would (one stage cache under the search's directory, so the source stage is made once; the
gate's baseline cache shared). Candidates go cheapest first (search/price.py, modelled);
each result is saved as soon as it is known (search/state.py), so a killed search resumes
from the candidates it finished; an early look (search/early.py) fails a bad candidate on a
quarter of the task items. Mixed precision (after the uniform schemes): the cheapest failing
uniform candidate's linear groups ranked by the weight error its quantisation report
measured, the k most sensitive kept float, k grown 1, 2, 4, … until the gate passes, then
bisected (search/probes.py). With `--ray`, the candidates run as tasks on a Ray cluster
instead (search/cluster/), judged by the same code (search/judge.py). Everything the search
cannot run — no candidate kiln accepts, calibration data they need, a search directory that
is a file — is refused before anything is written; a search that judged nothing removes
what it wrote. No library runs such a search over TensorRT-LLM targets, so this is ours.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from kiln.compiler.compile import compile_recipe
from kiln.compiler.preflight import run_preflight
from kiln.compiler.recipe.errors import RecipeError
from kiln.compiler.recipe.recipe import Recipe, load_recipe
from kiln.compiler.recipe.schema import QuantizationSection
from kiln.compiler.search.judge import judge_candidate
from kiln.compiler.search.pareto import closest, frontier, winner
from kiln.compiler.search.price import Price, price
from kiln.compiler.search.probes import walk
from kiln.compiler.search.settings import SearchSettings, check_settings, directory_problems
from kiln.compiler.search.space import (
    Candidate,
    mixed_candidate,
    sensitivities,
    uniform_candidates,
)
from kiln.compiler.search.state import (
    STATE,
    Judged,
    read_state,
    set_aside,
    state_key,
    write_state,
)
from kiln.compiler.trtllm.targets import PROFILES, get_profile
from kiln.quant import calibration
from kiln.runtime.base.errors import UsageError
from kiln.runtime.base.machine import describe_machine, machine_facts
from kiln.runtime.formats.artifact import MANIFEST

Progress = Callable[[str], None]


class Search:
    """One search: the recipe, its directory, the settings and what is judged so far."""

    def __init__(
        self,
        recipe: Recipe,
        settings: SearchSettings,
        out_dir: Path,
        registry: str | None,
        progress: Progress,
    ) -> None:
        self.recipe, self.settings, self.dir = recipe, settings, out_dir
        self.registry, self.say = registry, progress
        self.started = time.monotonic()
        self.judged: dict[str, Judged] = {}
        self.resumed = 0
        self.notes: list[str] = []
        pre = run_preflight(recipe, check_memory=False, need_checkpoint=True)
        self.info, self.deploy, self.path = pre.info, pre.deploy, pre.trtllm_path
        self.source = pre.source  # the float checkpoint every candidate is quantised from
        self.targets = settings.targets or list(recipe.config.targets)
        # What decides a verdict besides the recipe and the tools; the budget does not.
        self.key = state_key(recipe, {
            "targets": sorted(set(self.targets)), "schemes": sorted(set(settings.schemes)),
            "kv_cache": sorted(set(settings.kv_cache)), "mixed": settings.mixed,
            "early_stop": settings.early_stop,
        })  # fmt: skip
        self.stale: str | None = None  # why the state on disk is not resumed
        self.aside: Path | None = None  # where that state was moved
        self.before: set[Path] = set()  # what the search directory held (start())
        self.made: Path | None = None  # the directory start() created, if any
        self.cluster: dict[str, Any] | None = None  # the cluster it ran on (search/cluster/)

    # ---- state ---------------------------------------------------------------------------

    def load_state(self) -> None:
        """Resume the candidates a state written under this search's key holds."""
        rows, self.stale = read_state(self.dir, self.recipe.path, self.key)
        # A candidate whose workers died has no verdict to resume: it is judged again.
        self.judged = {j.candidate.id: j for j in rows if j.failed is None}
        self.resumed = len(self.judged)
        if self.stale:
            self.say(f"not resuming {self.dir / STATE}: {self.stale}; judging every "
                     "candidate afresh")  # fmt: skip

    def save_state(self) -> None:
        """Write what is judged so far (a state not resumed is first set aside)."""
        if self.stale and self.aside is None and (self.dir / STATE).is_file():
            self.aside = set_aside(self.dir)
            self.say(f"the earlier search's state is kept as {self.aside}")
        write_state(self.dir, self.recipe.path, self.key, list(self.judged.values()))

    def start(self) -> None:
        """Create the search directory, remembering what it already held (`undo`)."""
        self.before = {*_children(self.dir / "candidates"), *_children(self.dir)}
        self.made = None if self.dir.exists() else self.dir  # the first directory made
        while self.made is not None and not self.made.parent.exists():
            self.made = self.made.parent
        self.dir.mkdir(parents=True, exist_ok=True)

    def undo(self) -> None:
        """Remove what this run created, never what an earlier run left (its state, set
        aside, goes back in place)."""
        if self.made is not None:
            shutil.rmtree(self.made)
            return
        if self.aside is not None:
            os.replace(self.aside, self.dir / STATE)
        made = [*_children(self.dir / "candidates"), *_children(self.dir)]
        for path in (p for p in made if p not in self.before):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()

    # ---- one candidate ---------------------------------------------------------------------

    def write_recipe(self, cand: Candidate, output: Path | None = None) -> Path:
        """The candidate as a recipe of its own: the searched recipe, this quantization,
        compiled into `output` (default: the search's `artifacts/`)."""
        path = self.dir / "candidates" / f"{cand.id}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {
            "extends": os.path.relpath(self.recipe.path.resolve(), path.parent),
            "name": f"{self.recipe.name}-{cand.id}"[:64].rstrip("-."),
            "quantization": cand.quantization,
            "targets": cand.targets or self.targets,
            "output": os.path.relpath(output or self.dir / "artifacts", path.parent),
        }
        header = (
            f"# kiln search candidate {cand.id} ({cand.kind}) of {self.recipe.path}; "
            "`kiln compile` this file to reproduce it\n"
        )
        path.write_text(header + yaml.safe_dump(body, sort_keys=False))
        return path

    def judge(self, cand: Candidate) -> Judged:
        if cand.id in self.judged:
            return self.judged[cand.id]
        began = time.monotonic()
        path = self.write_recipe(cand)
        judged = Judged(cand, str(path), prices=self.prices(cand))
        judged = judge_candidate(judged, self.settings, self.registry, self.say)
        judged.seconds = time.monotonic() - began
        self.judged[cand.id] = judged
        self.save_state()
        return judged

    def prices(self, cand: Candidate) -> dict[str, Price]:
        """The candidate priced on each searched target that runs it."""
        return {
            t: price(self.info, cand.scheme, get_profile(t), self.deploy)
            for t in cand.targets or self.targets
        }

    # ---- the candidates ----------------------------------------------------------------------

    def space(self) -> list[Candidate]:
        """The uniform candidates, cheapest first: each scheme × KV variant whose recipe kiln
        accepts for some target (preflighted as `kiln compile` would), the rest noted with
        why. Calibration data a candidate needs, or no candidate at all, is a usage error
        found here, before anything is written."""
        s = self.settings
        ignore = list(self.recipe.config.quantization.ignore)
        uniform, skipped = uniform_candidates(
            s.schemes, s.kv_cache, self.targets, self.path, ignore, self.info
        )
        if any(c.scheme.needs_calibration for c in uniform):
            bad = calibration.check(self.recipe.calibration_spec())
            if bad:
                raise RecipeError([self.recipe.problem(p.key, p.problem, p.allowed) for p in bad])
        out = []
        for cand in uniform:
            why = {t: self._refusal(cand, t) for t in cand.targets}
            cand.targets = [t for t, problem in why.items() if problem is None]
            if cand.targets:
                out.append(cand)
            else:
                skipped[cand.id] = f"kiln refuses it ({next(iter(why.values()))})"
        self.notes += [f"{cid}: {why}" for cid, why in skipped.items()]
        if not out:
            raise UsageError(
                f"kiln search has no candidate to judge on {', '.join(self.targets)}: "
                + "; ".join(f"{cid} {why}" for cid, why in skipped.items())
                + "; choose schemes that these GPUs run (--schemes, search.schemes), or other "
                "GPUs (--target)"
            )
        return sorted(out, key=lambda c: _cheapest(self.prices(c)))

    def _refusal(self, cand: Candidate, target: str) -> str | None:
        """Why `kiln compile` would refuse the candidate's recipe for `target` (None: it
        would not), checked without writing it."""
        quant = QuantizationSection(**cand.quantization)
        config = self.recipe.config.model_copy(update={"quantization": quant, "targets": [target]})
        try:
            run_preflight(replace(self.recipe, config=config), check_memory=False)
        except RecipeError as exc:
            return re.sub(r"^\S+:\d+: ", "", exc.problems[0])  # the searched file's line is not it
        return None

    # ---- the loop ----------------------------------------------------------------------------

    def over_budget(self) -> str | None:
        s = self.settings
        fresh = len(self.judged) - self.resumed
        if s.max_candidates is not None and len(self.judged) >= s.max_candidates:
            return f"--max-candidates {s.max_candidates} reached"
        if s.budget_hours is not None and fresh:
            spent = time.monotonic() - self.started
            per = spent / fresh
            if spent + per > s.budget_hours * 3600:
                return (
                    f"--budget-hours {s.budget_hours} would be passed by the next "
                    f"candidate (~{per / 60:.1f} min each)"
                )
        return None

    def eta(self, remaining: int) -> str:
        """`, ETA ~N min` for `remaining` candidates at the mean so far (empty before one)."""
        fresh = [j.seconds for j in self.judged.values()][self.resumed :]
        if not fresh:
            return ""
        return f", ETA ~{remaining * sum(fresh) / len(fresh) / 60:.0f} min before mixed precision"

    def restore_recipes(self) -> None:
        """Write again the recipes of resumed candidates that were deleted since, and make
        again the artifacts of resumed candidates that passed and were deleted since (one of
        them may be the answer, which must name an artifact that exists); a failed one's
        deleted artifact is no longer named (the mixed search makes its parent's again)."""
        for j in self.judged.values():
            if not Path(j.recipe).is_file():
                j.recipe = str(self.write_recipe(j.candidate))
            if j.artifact is None or (Path(j.artifact) / MANIFEST).is_file():
                continue
            if j.passed:
                self.compile_again(j, "it passed its gate, so it may be the answer")
            else:
                self.say(f"{j.candidate.id}: its artifact {j.artifact} is gone; its verdict "
                         "stands, without an artifact")  # fmt: skip
                j.artifact = None
                self.save_state()

    def compile_again(self, judged: Judged, why: str) -> Path:
        """Compile a resumed candidate whose artifact was deleted since it was judged (the
        same recipe and tools: the same artifact, its verdict still valid)."""
        cid = judged.candidate.id
        gone = judged.artifact or "(deleted)"
        self.say(f"{cid}: its artifact {gone} is gone; compiling it again ({why})")
        path = self.write_recipe(judged.candidate)
        result = compile_recipe(path, progress=lambda text: self.say(f"{cid}: {text}"))
        judged.recipe, judged.artifact = str(path), str(result.artifact)
        self.save_state()
        return Path(result.artifact)

    def run(self, candidates: list[Candidate]) -> None:
        """Judge `candidates` (space()) in order, then the mixed-precision ones."""
        self.restore_recipes()
        total = len(candidates)
        for n, cand in enumerate(candidates, 1):
            if (why := self.over_budget()) is not None:
                self.notes.append(f"stopped before {cand.id}: {why}")
                return
            self.say(f"candidate {n} of {total} (+ mixed): {cand.id}{self.eta(total - n + 1)}")
            self.judge(cand)
        if self.settings.mixed:
            self.run_mixed()

    def run_mixed(self) -> None:
        """Judge the mixed-precision candidates one k at a time (search/probes.py)."""
        found = self.mixed_parent()
        if found is None:
            return
        parent, ranked = found
        top = len(ranked) - 1
        passed: dict[int, bool] = {}
        while (need := walk(passed, top).need) is not None:
            if (why := self.over_budget()) is not None:
                self.notes.append(f"mixed search stopped at k={need}: {why}")
                return
            cid = parent.candidate.id
            self.say(f"mixed: {cid} keeping the {need} most sensitive groups float")
            passed[need] = self.judge(mixed_candidate(parent.candidate, ranked, need)).passed
        self.note_mixed_answer(parent, ranked, passed)

    def mixed_parent(self) -> tuple[Judged, list[tuple[float, list[str]]]] | None:
        """The uniform candidate the mixed ones keep layers of float — the cheapest that
        failed, cheaper than the cheapest that passed — and its groups ranked by measured
        sensitivity; None (with a note saying why) when there is none to try."""
        uniform = [j for j in self.judged.values() if j.candidate.kind == "uniform"]
        passing = [j for j in uniform if j.passed]
        cheapest_pass = min((_cheapest(j.prices) for j in passing), default=math.inf)
        parents = sorted(
            (
                j
                for j in uniform
                if j.quality is not None and not j.passed and _cheapest(j.prices) < cheapest_pass
            ),
            key=lambda j: _cheapest(j.prices),
        )
        if not parents:
            self.notes.append(
                "no mixed-precision candidate: "
                + (
                    "no uniform candidate was judged"
                    if not uniform
                    else "every uniform scheme cheaper than the cheapest passing one passed, so "
                    "keeping layers float could only cost more"
                )
            )
            return None
        parent = parents[0]
        if (why := self.over_budget()) is not None:  # before compiling a parent again
            self.notes.append(f"mixed search stopped at k=1: {why}")
            return None
        ranked = sensitivities(self.parent_report(parent), self.info)
        if len(ranked) < 2:  # keeping every group float quantises nothing
            self.notes.append(f"no mixed-precision candidate: {parent.candidate.id} has one group")
            return None
        return parent, ranked

    def note_mixed_answer(
        self, parent: Judged, ranked: list[tuple[float, list[str]]], passed: dict[int, bool]
    ) -> None:
        """Note a mixed search that ended with no k passing."""
        top = len(ranked) - 1
        if walk(passed, top).best is None:
            self.notes.append(
                f"no mixed candidate of {parent.candidate.id} passed, even "
                f"with {top} of {len(ranked)} groups float"
            )

    def parent_report(self, parent: Judged) -> dict[str, Any]:
        """The quantisation report of a mixed candidate's parent; its artifact compiled again
        (the same recipe and tools: the same artifact, its verdict still valid) when it was
        deleted since it was judged."""
        report = Path(str(parent.artifact)) / "reports" / "quantization.json"
        if parent.artifact is None or not report.is_file():
            made = self.compile_again(parent, "for its per-layer report")
            report = made / "reports" / "quantization.json"
        return dict(json.loads(report.read_text()))

    # ---- the answer ---------------------------------------------------------------------------

    def rows(self, target: str) -> list[dict[str, Any]]:
        out = []
        for j in self.judged.values():
            p = j.prices.get(target)
            if j.quality is None or p is None:
                continue
            out.append(
                {
                    "id": j.candidate.id,
                    "kind": j.candidate.kind,
                    "passed": j.quality.passed,
                    "price": p.per_million_tokens if p.fits else None,
                    "score": j.quality.score,
                    "failed_checks": j.quality.failed_checks,
                    "quality": j.quality.to_dict(),
                    "plan": p.to_dict(),
                    "recipe": j.recipe,
                    "artifact": j.artifact,
                    "measured_tokens_per_s": j.measured_tokens_per_s,
                    "screened_out": j.quality.screened_out,
                }
            )
        return out

    def answer(self) -> dict[str, Any]:
        facts = machine_facts()
        per_target = {}
        for t in self.targets:
            rows = self.rows(t)
            best = winner(rows)
            near = closest(rows) if best is None else None
            per_target[t] = {
                "gpu": PROFILES[t].marketing_name,
                "rows": rows,
                "frontier": frontier(rows),
                "winner": best,
                "closest": near and {"id": near["id"], "failed_checks": near["failed_checks"]},
            }
        screened = [j for j in self.judged.values() if j.quality and j.quality.screened_out]
        return {
            "recipe": str(self.recipe.path),
            "targets": per_target,
            "machine": describe_machine(facts),
            "candidates": [j.to_dict() for j in self.judged.values()],
            "refused": {j.candidate.id: j.refused for j in self.judged.values() if j.refused},
            "failed": {j.candidate.id: j.failed for j in self.judged.values() if j.failed},
            "cluster": self.cluster,
            "early_stop": {
                "screened_out": len(screened),
                "candidates": [j.candidate.id for j in screened],
            },
            "resumed": self.resumed,
            "seconds": round(time.monotonic() - self.started, 1),
            "notes": self.notes,
            "price_source": "modelled (compiler/search/price.py)",
        }


def _cheapest(prices: dict[str, Price]) -> float:
    """A candidate's expected price: its lowest across the targets (inf where none fits)."""
    known = [p.per_million_tokens for p in prices.values() if p.per_million_tokens is not None]
    return min(known) if known else math.inf


def _children(path: Path) -> list[Path]:
    return list(path.iterdir()) if path.is_dir() and not path.is_symlink() else []


def judge_here(search: Search, candidates: list[Candidate]) -> None:
    """Judge the candidates one after another on this machine, resuming a saved state."""
    search.load_state()
    search.start()
    search.run(candidates)


def run_search(
    recipe_path: Path,
    settings: SearchSettings,
    out_dir: Path,
    registry: str | None = None,
    progress: Progress | None = None,
    fan_out: Callable[[Search, list[Candidate]], None] | None = None,
) -> dict[str, Any]:
    """Search, write search.json/.md/.html and each target's winning recipe into `out_dir`,
    and return search.json's content. The candidates are judged one after another here, or
    by `fan_out` (a Ray cluster's tasks: search/cluster.py)."""
    from kiln.compiler.search.report import write_reports

    recipe = load_recipe(recipe_path)
    problems = check_settings(recipe, settings) + directory_problems(out_dir)
    if problems:
        raise UsageError("\n".join(problems))
    search = Search(recipe, settings, out_dir, registry, progress or (lambda _t: None))
    candidates = search.space()
    (fan_out or judge_here)(search, candidates)
    if not any(j.quality for j in search.judged.values()):
        search.undo()
        refused = [f"{j.candidate.id}: {j.refused}" for j in search.judged.values() if j.refused]
        failed = [f"{j.candidate.id}: {j.failed}" for j in search.judged.values() if j.failed]
        why = [f"kiln compile refused {'; '.join(refused)}"] if refused else []
        why += [f"the cluster could not run {'; '.join(failed)}"] if failed else []
        raise UsageError(
            f"kiln search judged no candidate: {'; '.join(why)}; fix the recipe and rerun "
            "(nothing this run wrote was kept)"
        )
    answer = search.answer()
    write_reports(out_dir, answer)
    return answer
