"""`kiln search`: the cheapest deployment of a recipe that passes its gate, per GPU target.

Each candidate (search/space.py) is written out as a recipe that `extends:` the searched one
and replaces its quantization section, then compiled and gated exactly as `kiln compile`
would (one stage cache under the search's directory, so the source stage is made once; the
gate's baseline cache shared). Candidates go cheapest first (search/price.py, modelled);
each result is saved as soon as it is known, so a killed search resumes from the candidates
it finished. The early look gates a candidate on a quarter of the task items first, at a
stricter confidence (0.99), with the same divergence texts and no traffic replay: a task
whose loss bound already fails there, or a divergence check that fails (the same texts as
the full gate), fails the candidate without the full run; the early look fails a good
candidate at most 1% of the time per task, so the search's false rejections stay within the
gate's own 5% plus 1%. Mixed precision (after the uniform
schemes): the cheapest failing uniform candidate's linear groups ranked by the weight error
its quantisation report measured, the k most sensitive kept float, k grown 1, 2, 4, … until
the gate passes, then bisected. No library runs such a search over TensorRT-LLM targets, so
this is ours.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from kiln.compiler.compile import compile_recipe
from kiln.compiler.gating import gate_compiled
from kiln.compiler.preflight import run_preflight
from kiln.compiler.recipe.recipe import Recipe, load_recipe
from kiln.compiler.search.pareto import Quality, closest, frontier, quality_of, winner
from kiln.compiler.search.price import Price, price
from kiln.compiler.search.space import (
    KV_VARIANTS,
    SCHEMES,
    Candidate,
    mixed_candidate,
    sensitivities,
    uniform_candidates,
    unknown_schemes,
)
from kiln.compiler.trtllm.targets import PROFILES, get_profile
from kiln.gates.decide.checks import DIVERGENCE_CHECKS
from kiln.gates.releases import Registry
from kiln.gates.settings import ShadowSection
from kiln.runtime.base.errors import KilnError, UsageError
from kiln.runtime.base.machine import describe_machine, machine_facts

STATE = "state.json"
SCREEN_FRACTION, SCREEN_CONFIDENCE, SCREEN_MIN_ITEMS = 0.25, 0.99, 32
DEFAULT_ITEMS = 400  # what the early look assumes a task holds when gates.limit is unset
Progress = Callable[[str], None]


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


@dataclass
class Judged:
    """One candidate's outcome: its recipe, artifact, gate quality and prices."""

    candidate: Candidate
    recipe: str
    artifact: str | None = None
    quality: Quality | None = None
    prices: dict[str, Price] = field(default_factory=dict)
    refused: str | None = None  # compile refused it: the message
    seconds: float = 0.0
    measured_tokens_per_s: float | None = None
    screen: dict[str, Any] | None = None  # the early look's verdict summary

    def to_dict(self) -> dict[str, Any]:
        c = self.candidate
        return {
            "id": c.id,
            "kind": c.kind,
            "scheme": c.scheme_name,
            "parent": c.parent,
            "kept_float": c.kept_float,
            "quantization": c.quantization,
            "recipe": self.recipe,
            "artifact": self.artifact,
            "refused": self.refused,
            "seconds": round(self.seconds, 1),
            "quality": self.quality.to_dict() if self.quality else None,
            "prices": {t: p.to_dict() for t, p in self.prices.items()},
            "measured_tokens_per_s": self.measured_tokens_per_s,
            "screen": self.screen,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Judged:
        cand = Candidate(
            data["id"],
            data["scheme"],
            data["quantization"],
            data["kind"],
            data.get("kept_float") or [],
            data.get("parent"),
        )
        q = data.get("quality")
        prices = {
            t: Price(**{k: v for k, v in p.items() if k != "source"})
            for t, p in data.get("prices", {}).items()
        }
        return cls(
            cand,
            data["recipe"],
            data.get("artifact"),
            Quality(**q) if q else None,
            prices,
            data.get("refused"),
            data.get("seconds", 0.0),
            data.get("measured_tokens_per_s"),
            data.get("screen"),
        )

    @property
    def passed(self) -> bool:
        return self.quality is not None and self.quality.passed


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
        pre = run_preflight(recipe, check_memory=False)
        self.info, self.deploy, self.path = pre.info, pre.deploy, pre.trtllm_path
        self.targets = settings.targets or list(recipe.config.targets)

    # ---- state ---------------------------------------------------------------------------

    def load_state(self) -> None:
        path = self.dir / STATE
        if not path.is_file():
            return
        data = json.loads(path.read_text())
        if data.get("recipe") != str(self.recipe.path):
            raise UsageError(
                f"{self.dir}: holds a search of {data.get('recipe')}; give "
                "another --output for this recipe"
            )
        for row in data.get("candidates", []):
            self.judged[row["id"]] = Judged.from_dict(row)
        self.resumed = len(self.judged)

    def save_state(self) -> None:
        data = {
            "recipe": str(self.recipe.path),
            "candidates": [j.to_dict() for j in self.judged.values()],
        }
        tmp = self.dir / f".{STATE}.tmp"
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, self.dir / STATE)  # never a half-written state

    # ---- one candidate ---------------------------------------------------------------------

    def write_recipe(self, cand: Candidate) -> Path:
        """The candidate as a recipe of its own: the searched recipe, this quantization."""
        path = self.dir / "candidates" / f"{cand.id}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {
            "extends": os.path.relpath(self.recipe.path.resolve(), path.parent),
            "name": f"{self.recipe.name}-{cand.id}"[:64].rstrip("-."),
            "quantization": cand.quantization,
            "targets": self.targets,
            "output": os.path.relpath(self.dir / "artifacts", path.parent),
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
        try:
            judged = self._compile_and_gate(judged, path)
        except KilnError as exc:  # a recipe kiln refuses: recorded, the search goes on
            judged.refused = " ".join(str(exc).split())[:600]
        judged.seconds = time.monotonic() - began
        self.judged[cand.id] = judged
        self.save_state()
        return judged

    def _compile_and_gate(self, judged: Judged, path: Path) -> Judged:
        cand = judged.candidate
        self.say(f"{cand.id}: compiling")
        recipe = load_recipe(path)
        result = compile_recipe(path, progress=lambda text: self.say(f"{cand.id}: {text}"))
        judged.artifact = str(result.artifact)
        with Registry(self.registry) as registry:
            screen = self._screen_recipe(recipe) if self.settings.early_stop else None
            if screen is not None:
                self.say(f"{cand.id}: early look")
                step = gate_compiled(result, screen, registry=registry)
                assert step is not None
                if _decided_fail(step.verdict):
                    judged.screen = {"failed": True, "checks": step.failed_checks}
                    judged.quality = quality_of(step.verdict, screened_out=True)
                    return judged
                judged.screen = {"failed": False}
            self.say(f"{cand.id}: gating")
            step = gate_compiled(result, recipe, registry=registry)
            assert step is not None
            judged.quality = quality_of(step.verdict)
        if self.settings.measure:
            judged.measured_tokens_per_s = _measure_decode(result.artifact / "model")
        return judged

    def _screen_recipe(self, recipe: Recipe) -> Recipe | None:
        """The recipe whose gate looks at a quarter of the task items at confidence 0.99 and
        the same divergence texts, replaying no traffic and measuring no noise floor (None
        when the gate has too few items, or no tasks, for an early look to save anything)."""
        gates = recipe.config.gates
        assert gates is not None
        items = gates.limit or DEFAULT_ITEMS
        if not gates.tasks or items < SCREEN_MIN_ITEMS:
            return None
        thresholds = gates.thresholds.model_copy(update={"confidence": SCREEN_CONFIDENCE})
        screened = gates.model_copy(
            update={
                "limit": max(1, math.ceil(items * SCREEN_FRACTION)),
                "thresholds": thresholds,
                "shadow": ShadowSection(),
                "noise_floor": "off",
            }
        )
        return replace(recipe, config=recipe.config.model_copy(update={"gates": screened}))

    def prices(self, cand: Candidate) -> dict[str, Price]:
        return {t: price(self.info, cand.scheme, get_profile(t), self.deploy) for t in self.targets}

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

    def run(self) -> None:
        s = self.settings
        candidates, skipped = uniform_candidates(
            s.schemes,
            s.kv_cache,
            self.targets,
            self.path,
            list(self.recipe.config.quantization.ignore),
            self.info,
        )
        for cid, problems in skipped.items():
            self.notes.append(f"{cid}: runs on none of the targets ({problems[0].problem})")
        candidates.sort(key=lambda c: _cheapest(self.prices(c)))
        total = len(candidates)
        for n, cand in enumerate(candidates, 1):
            if (why := self.over_budget()) is not None:
                self.notes.append(f"stopped before {cand.id}: {why}")
                return
            self.say(f"candidate {n} of {total} (+ mixed): {cand.id}{self.eta(total - n + 1)}")
            self.judge(cand)
        if s.mixed:
            self.run_mixed()

    def run_mixed(self) -> None:
        uniform = [j for j in self.judged.values() if j.candidate.kind == "uniform"]
        passing = [j for j in uniform if j.passed]
        cheapest_pass = min((_cheapest(j.prices) for j in passing), default=math.inf)
        parents = sorted(
            (
                j
                for j in uniform
                if j.quality is not None
                and not j.passed
                and _cheapest(j.prices) < cheapest_pass
                and j.artifact is not None
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
            return
        parent = parents[0]
        report = json.loads(
            (Path(str(parent.artifact)) / "reports" / "quantization.json").read_text()
        )
        ranked = sensitivities(report, self.info)
        top = len(ranked) - 1  # keeping every group float quantises nothing
        if top < 1:
            self.notes.append(f"no mixed-precision candidate: {parent.candidate.id} has one group")
            return

        def probe(k: int) -> bool | None:
            if (why := self.over_budget()) is not None:
                self.notes.append(f"mixed search stopped at k={k}: {why}")
                return None
            self.say(f"mixed: {parent.candidate.id} keeping the {k} most sensitive groups float")
            return self.judge(mixed_candidate(parent.candidate, ranked, k)).passed

        k, low = 1, 0
        while True:  # grow k 1, 2, 4, ... until a pass
            ok = probe(min(k, top))
            if ok is None:
                return
            if ok:
                break
            if k >= top:
                self.notes.append(
                    f"no mixed candidate of {parent.candidate.id} passed, even "
                    f"with {top} of {len(ranked)} groups float"
                )
                return
            low, k = min(k, top), min(2 * k, top)
        high = min(k, top)
        while high - low > 1:  # the smallest k that passes lies in (low, high]
            mid = (low + high) // 2
            ok = probe(mid)
            if ok is None:
                return
            low, high = (low, mid) if ok else (mid, high)

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


def _decided_fail(verdict: dict[str, Any]) -> bool:
    """The early look's verdict settles a fail: a task's loss bound beyond its margin, or a
    failed divergence check (measured on the same texts as the full gate). A perplexity ratio
    or accuracy on a quarter of the items settles nothing."""
    tasks = [t.get("decision") or {} for t in verdict.get("tasks", [])]
    if any(d.get("outcome") == "fail" for d in tasks):
        return True
    return any(not c.get("passed") and c["name"] in DIVERGENCE_CHECKS
               for c in verdict.get("checks", []))  # fmt: skip


def _measure_decode(model_dir: Path, tokens: int = 32) -> float:
    """kiln's runtime decode tokens/s on this machine, one greedy sequence."""
    from kiln.runtime import Engine, SamplingParams

    engine = Engine.from_pretrained(model_dir)
    prompt = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    began = time.perf_counter()
    out = engine.generate([prompt], params)[0]
    return len(out.token_ids) / (time.perf_counter() - began)


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
        problems.append(f"unknown GPU targets {unknown}: use {', '.join(PROFILES)}")
    bad = unknown_schemes(settings.schemes)
    if bad:
        problems.append(f"unknown schemes {bad}: use {', '.join(SCHEMES)}")
    bad_kv = [k for k in settings.kv_cache if k not in KV_VARIANTS]
    if bad_kv:
        problems.append(f"unknown KV cache variants {bad_kv}: use {', '.join(KV_VARIANTS)}")
    return problems


def run_search(
    recipe_path: Path,
    settings: SearchSettings,
    out_dir: Path,
    registry: str | None = None,
    progress: Progress | None = None,
) -> dict[str, Any]:
    """Search, write search.json/.md/.html and each target's winning recipe into `out_dir`,
    and return search.json's content."""
    from kiln.compiler.search.report import write_reports

    recipe = load_recipe(recipe_path)
    problems = check_settings(recipe, settings)
    if problems:
        raise UsageError("\n".join(problems))
    out_dir.mkdir(parents=True, exist_ok=True)
    search = Search(recipe, settings, out_dir, registry, progress or (lambda _t: None))
    search.load_state()
    search.run()
    answer = search.answer()
    write_reports(out_dir, answer)
    return answer
