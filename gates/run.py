"""Run a gate: evaluate candidate and baseline, compare, decide, report, record.

Order of work, chosen to keep at most one model side loaded at a time where possible:
1. lm-eval tasks on the candidate (through the runtime: the gate evaluates what ships),
   plus its top-k next-token log-probabilities on held-out text;
2. the same on the baseline (runtime for an artifact, transformers for a float source)
   and on its control, the float source served by the runtime in the candidate's compute
   dtype (the noise floor);
3. replay of recorded traffic through both sides (runtime engines or endpoints) and the
   shadow comparison of their answers; a model baseline's answers and its shadow control's
   come from the evaluation cache where it holds them (gates/measure/shadow_step.py);
4. the verdict, its reports (gate.json, gate.md, gate.html) and the registry record.

An http(s) endpoint side has no log-probabilities to score tasks with, so a gate with an
endpoint on either side compares shadow traffic only and says so in its notes.
`gate_mirror_log` judges the pairs `kiln serve --mirror` logged instead (step 3 without
replay, no tasks) and finishes through the same step 4.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.gates.decide.compare import Comparisons
from kiln.gates.decide.rules import GatePolicy
from kiln.gates.decide.verdict import (
    GateVerdict,
    build_verdict,
)
from kiln.gates.evaluate import compare_models
from kiln.gates.measure.divergence_texts import resolve_path
from kiln.gates.measure.eval_cache import (
    EvaluationCache,
)
from kiln.gates.measure.served import parse_engine
from kiln.gates.measure.shadow import compare_pair, summarize_pairs
from kiln.gates.measure.shadow_step import Progress, ShadowSetup, shadow_step
from kiln.gates.measure.sides import SideSpec, check_distinct, resolve_side
from kiln.gates.on_engine import Traffic, compare_on_engine
from kiln.gates.releases import Registry
from kiln.gates.report import write_reports
from kiln.gates.settings import GatesSection
from kiln.runtime.base.errors import UsageError
from kiln.runtime.base.machine import machine_facts
from kiln.runtime.base.versions import GATE_TOOLS, kiln_version, version, versions
from kiln.runtime.formats.artifact.verified import Mode
from kiln.runtime.formats.mirror_log import MirrorEntry, read_mirror_log
from kiln.runtime.formats.traffic import COMPLETIONS, TrafficRecord, read_traffic


@dataclass(slots=True)
class GateOutcome:
    """A finished gate: its verdict, where its reports are, its registry run id."""

    verdict: GateVerdict
    reports: dict[str, Path]
    run_id: int | None = None
    candidate: SideSpec | None = None
    baseline: SideSpec | None = None
    notes: list[str] = field(default_factory=list)


def run_gate(
    candidate: str,
    baseline: str,
    gates: GatesSection,
    out_dir: str | Path,
    *,
    base_dir: Path | None = None,
    traffic: str | Path | None = None,
    registry: Registry | None = None,
    progress: Progress | None = None,
    verify: Mode = "fast",
) -> GateOutcome:
    """Gate `candidate` against `baseline`; writes reports and records the run. Artifact
    sides are checked against their manifests first (`verify`)."""
    say = progress or (lambda _msg: None)
    began = time.perf_counter()
    base_dir = base_dir or Path.cwd()
    cand = resolve_side(candidate, "candidate", verify)
    base = resolve_side(baseline, "baseline", verify)
    check_distinct(cand, base, registry is not None)
    if cand.kind == "source":
        raise UsageError(
            f"candidate {candidate!r} is a model source; the gate evaluates what ships: pass "
            "the artifact `kiln compile` produced (or the URL of the endpoint serving it)"
        )
    policy = gates.policy(cand.weight_bits)
    traffic_path = Path(traffic) if traffic else resolve_path(gates.shadow.traffic, base_dir)
    records = read_traffic(traffic_path) if traffic_path else []
    notes: list[str] = []
    in_process = gates.engine == "kiln"
    model_sides = cand.kind != "http" and base.kind != "http"
    if not model_sides and in_process:
        notes.append("lm-eval tasks and KL divergence skipped: an endpoint side has no logprobs")
        if not records:
            raise UsageError(
                "an http(s) endpoint side is compared by shadow traffic only; pass --traffic "
                "FILE (recorded requests) or gates.shadow.traffic"
            )
    if (model_sides or not in_process) and not (gates.tasks or gates.divergence.enabled or records):
        raise UsageError(
            "the gate has nothing to measure: gates.tasks is empty, gates.divergence is off "
            "and no traffic was given; set one of them"
        )
    choice = parse_engine(
        gates.engine,
        gates.engine_args,
        gates.engine_target,
        gates.engine_timeout_s,
        gates.engine_model,
    )
    if not choice.in_process:
        traffic_run = None
        if records:
            timeout = gates.shadow.timeout_s
            traffic_run = Traffic(records, gates.shadow.settings(), timeout)
        log_dir = Path(out_dir) / "engines"
        compared = compare_on_engine(
            cand, base, gates, policy, choice, base_dir, log_dir, traffic_run, say, notes
        )
        return _finish(cand, base, policy, compared, out_dir, registry, notes, began)
    compared, cand_engine, base_engine = Comparisons(), None, None
    if model_sides and (gates.tasks or gates.divergence.enabled):
        compared, (cand_engine, base_engine) = compare_models(
            cand, base, gates, policy, base_dir, say, notes
        )
    if records and traffic_path is not None:
        # Cached baseline timings were measured under another moment's load: a gated timing
        # ratio replays the baseline again.
        timed = policy.shadow_ttft_p50_ratio_max or policy.shadow_tpot_p50_ratio_max
        setup = ShadowSetup(
            records,
            traffic_path,
            gates.shadow.settings(),
            EvaluationCache() if gates.baseline_cache else None,
            {"shadow-baseline"} if timed is not None else set(),
            gates.shadow.timeout_s,
            gates.noise_floor != "off",
        )
        compared.shadow = shadow_step(cand, base, (cand_engine, base_engine), setup, notes, say)
    compared.engines = in_process_engines(cand, base)
    return _finish(cand, base, policy, compared, out_dir, registry, notes, began)


def in_process_engines(cand: SideSpec, base: SideSpec) -> dict[str, Any]:
    """The engines record of a gate run in this process: kiln's runtime for an artifact,
    transformers for a float source, the URL for an endpoint; and the machine."""

    def one(side: SideSpec) -> dict[str, Any]:
        if side.kind == "http":
            return {"engine": "url", "url": side.url}
        if side.kind == "source":
            return {"engine": "transformers", "version": version("transformers")}
        return {"engine": "kiln", "version": kiln_version()}

    return {"candidate": one(cand), "baseline": one(base), "machine": machine_facts()}


def gate_mirror_log(
    candidate: str,
    baseline: str,
    log: str | Path,
    gates: GatesSection,
    out_dir: str | Path,
    *,
    registry: Registry | None = None,
    verify: Mode = "fast",
) -> GateOutcome:
    """Gate `candidate` against `baseline` on the answer pairs of a mirror log (`kiln serve
    --mirror`, baseline = the primary): the shadow comparison only; writes reports and
    records the run like `run_gate`."""
    began = time.perf_counter()
    cand = resolve_side(candidate, "candidate", verify)
    base = resolve_side(baseline, "baseline", verify)
    check_distinct(cand, base, registry is not None)
    entries = read_mirror_log(log)
    for entry in entries:
        _check_mirrored(log, entry, cand, base)
    pairs = [
        compare_pair(
            TrafficRecord(e.id, e.time, COMPLETIONS, {**e.settings, "prompt": e.prompt}),
            e.primary,
            e.candidate,
        )
        for e in entries
    ]
    base_answers, cand_answers = [e.primary for e in entries], [e.candidate for e in entries]
    shadow = summarize_pairs(pairs, base_answers, cand_answers, {"mirror_log": str(log)})
    notes = [
        f"mirror log {log}: {len(entries)} mirrored requests with their own sampling "
        "settings; the primary's latency was measured under live load"
    ]
    policy = gates.policy(cand.weight_bits)
    compared = Comparisons(shadow=shadow)
    return _finish(cand, base, policy, compared, out_dir, registry, notes, began)


def _check_mirrored(log: str | Path, entry: MirrorEntry, cand: SideSpec, base: SideSpec) -> None:
    """Refuse a log whose answers came from other artifacts than the two being gated."""
    for side, logged, role in (
        (cand, entry.candidate, "candidate"),
        (base, entry.primary, "primary"),
    ):
        if side.kind == "artifact" and logged.digest and logged.digest != side.digest:
            raise UsageError(
                f"{log}: request {entry.id} was mirrored with {role} {logged.model} "
                f"{logged.digest[:12]}, not {side.spec} ({side.digest[:12]})"
            )


def _finish(
    cand: SideSpec,
    base: SideSpec,
    policy: GatePolicy,
    compared: Comparisons,
    out_dir: str | Path,
    registry: Registry | None,
    notes: list[str],
    began: float,
) -> GateOutcome:
    """The verdict on what was compared, its reports and its registry record."""
    verdict = build_verdict(
        cand.to_dict(),
        base.to_dict(),
        policy,
        compared,
        tools=versions(GATE_TOOLS, python=True),
        notes=notes,
        seconds=round(time.perf_counter() - began, 3),
    )
    reports = write_reports(verdict, out_dir)
    run_id = None
    if registry is not None:
        run_id = registry.record_gate_run(
            verdict.to_dict(), cand.path if cand.kind == "artifact" else None
        )
    return GateOutcome(verdict, reports, run_id, cand, base, notes)
