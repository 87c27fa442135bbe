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

import gc
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.gates.decide.compare import Comparisons, compare_results
from kiln.gates.decide.rules import GatePolicy
from kiln.gates.decide.verdict import (
    GateVerdict,
    build_verdict,
)
from kiln.gates.measure.divergence import DivergenceSummary, kl_topk, summarize
from kiln.gates.measure.divergence_texts import divergence_ids, divergence_texts, resolve_path
from kiln.gates.measure.eval_cache import (
    EvaluationCache,
    decode,
    encode,
    evaluation_key,
    files_digest,
)
from kiln.gates.measure.noise_floor import NoiseFloor, control_dtype, describe_control
from kiln.gates.measure.shadow import compare_pair, summarize_pairs
from kiln.gates.measure.shadow_step import Progress, ShadowSetup, shadow_step
from kiln.gates.measure.sides import SideSpec, check_distinct, resolve_side
from kiln.gates.measure.tasks import BUILTIN_TASKS_DIR, TaskResult
from kiln.gates.releases import Registry
from kiln.gates.report import write_reports
from kiln.gates.settings import GatesSection
from kiln.runtime.base.errors import UsageError
from kiln.runtime.base.versions import GATE_TOOLS, versions
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


@dataclass(slots=True)
class _SideEval:
    results: dict[str, TaskResult]
    topk: list[list[dict[int, float]]] | None
    token_ids: list[list[int]] | None
    engine: Any = None


def _task_dirs(gates: GatesSection, base_dir: Path) -> list[Path]:
    extra = resolve_path(gates.tasks_dir, base_dir)
    return [BUILTIN_TASKS_DIR] if extra is None else [BUILTIN_TASKS_DIR, extra]


def _load_lm(
    side: SideSpec, max_length: int | None, runtime_dtype: str | None = None
) -> tuple[Any, Callable[..., Any], Any]:
    """An lm-eval model of one side, its top-k logprob function, and its runtime engine.
    An artifact, or any side given a `runtime_dtype`, is served by kiln's runtime; a float
    source without one by transformers."""
    from kiln.gates.measure.lm_eval_adapter import KilnLM, hf_source_lm, hf_topk_logprobs

    if side.kind == "artifact" or runtime_dtype is not None:
        config = {"dtype": runtime_dtype} if runtime_dtype else {}
        lm: Any = KilnLM(artifact=str(side.path), max_length=max_length, **config)
        return lm, lm.topk_logprobs, lm.engine
    lm = hf_source_lm(str(side.path), max_length=max_length or 2048)

    def topk_fn(ids: list[list[int]], k: int) -> list[list[dict[int, float]]]:
        return hf_topk_logprobs(lm, ids, k)

    return lm, topk_fn, None


def _run_lm(
    lm: Any, topk_fn: Callable[..., Any], gates: GatesSection, texts: list[str], base_dir: Path
) -> _SideEval:
    """lm-eval tasks and top-k logprobs on the divergence texts, through one loaded model."""
    from kiln.gates.measure.tasks import run_tasks

    results = {}
    if gates.tasks:  # a gate of distribution checks only runs no lm-eval task
        results = run_tasks(
            lm, gates.tasks, _task_dirs(gates, base_dir), gates.limit, gates.num_fewshot or None
        )
    topk = ids = None
    if gates.divergence.enabled and texts:
        ids = divergence_ids(
            texts, lm.tok_encode, gates.divergence.tokens, gates.divergence.max_seq_len
        )
        topk = topk_fn(ids, gates.divergence.top_k)
    return _SideEval(results, topk, ids)


def _evaluate_side(
    side: SideSpec, gates: GatesSection, texts: list[str], max_length: int | None, base_dir: Path
) -> tuple[_SideEval, int]:
    """lm-eval tasks and top-k logprobs of one model side; returns its max_length too."""
    lm, topk_fn, engine = _load_lm(side, max_length)
    evaluated = _run_lm(lm, topk_fn, gates, texts, base_dir)
    evaluated.engine = engine
    return evaluated, int(lm.max_length)


def _evaluation_key(
    side: SideSpec, role: str, gates: GatesSection, texts: list[str], max_length: int,
    base_dir: Path,
) -> str:  # fmt: skip
    """What shapes a side's evaluation (see gates/measure/eval_cache.py)."""
    task_files = [
        p for d in _task_dirs(gates, base_dir) if d.is_dir() for p in d.iterdir() if p.is_file()
    ]
    return evaluation_key(
        {
            "side": side.digest,
            "role": role,
            "tasks": gates.tasks,
            "task_files": files_digest(task_files),
            "limit": gates.limit,
            "num_fewshot": gates.num_fewshot,
            "divergence": gates.divergence.model_dump() if gates.divergence.enabled else None,
            "texts": texts if gates.divergence.enabled else None,
            "max_length": max_length,
            "tools": versions(GATE_TOOLS, python=True),
        }
    )


def _evaluate_baseline(
    side: SideSpec,
    gates: GatesSection,
    texts: list[str],
    max_length: int,
    base_dir: Path,
    say: Progress,
    control: str | None,
) -> tuple[_SideEval, _SideEval | None]:
    """The baseline's evaluation and, when `control` names a compute dtype, its control's
    (the baseline served by the runtime in that dtype: the noise floor), each from the
    evaluation cache when it holds them."""
    # The role names how the control was computed, so a control cached by another method
    # (or in another dtype) is never taken for this one.
    roles = {"baseline": None} | ({f"control-runtime-{control}": control} if control else {})
    cache = EvaluationCache() if gates.baseline_cache else None
    keys = {r: _evaluation_key(side, r, gates, texts, max_length, base_dir) for r in roles}
    found: dict[str, _SideEval] = {}
    for role in roles:
        data = cache.get(keys[role]) if cache else None
        if data is not None:
            found[role] = _SideEval(*decode(data))
            say(f"{role}: cached evaluation {keys[role][:12]}")
    for role, dtype in roles.items():
        if role in found:
            continue
        if dtype is None:
            say(f"baseline: {', '.join(gates.tasks) or 'no tasks'} ({side.kind})")
        else:
            say(f"control: {describe_control(dtype)} (the noise floor)")
        lm, topk_fn, engine = _load_lm(side, max_length, dtype)
        found[role] = done = _run_lm(lm, topk_fn, gates, texts, base_dir)
        if dtype is None:
            done.engine = engine
        if cache is not None:
            cache.put(keys[role], encode(done.results, done.topk, done.token_ids))
        del lm, topk_fn, engine
        gc.collect()  # one model side loaded at a time
    control_eval = found[list(roles)[-1]] if control else None
    return found["baseline"], control_eval


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
    model_sides = cand.kind != "http" and base.kind != "http"
    if not model_sides:
        notes.append("lm-eval tasks and KL divergence skipped: an endpoint side has no logprobs")
        if not records:
            raise UsageError(
                "an http(s) endpoint side is compared by shadow traffic only; pass --traffic "
                "FILE (recorded requests) or gates.shadow.traffic"
            )
    if model_sides and not (gates.tasks or gates.divergence.enabled or records):
        raise UsageError(
            "the gate has nothing to measure: gates.tasks is empty, gates.divergence is off "
            "and no traffic was given; set one of them"
        )
    compared = Comparisons()
    cand_engine = base_engine = None
    if model_sides and (gates.tasks or gates.divergence.enabled):
        texts = (
            divergence_texts(gates.divergence.texts, gates.divergence.num_texts, base_dir)
            if gates.divergence.enabled
            else []
        )
        say(f"candidate: {', '.join(gates.tasks) or 'no tasks'} through the runtime")
        c_eval, max_length = _evaluate_side(cand, gates, texts, None, base_dir)
        cand_engine = c_eval.engine
        control = None
        if base.kind == "source" and gates.noise_floor != "off":
            control = control_dtype(gates.noise_floor, cand_engine)
        b_eval, ctrl_eval = _evaluate_baseline(
            base, gates, texts, max_length, base_dir, say, control
        )
        base_engine = b_eval.engine
        compared = compare_results(b_eval.results, c_eval.results, policy)
        compared.divergence = _divergence(b_eval, c_eval, gates, notes)
        if ctrl_eval is not None and control is not None:
            compared.noise_floor = _noise_floor(b_eval, ctrl_eval, control, gates, policy)
        elif gates.noise_floor != "off":
            notes.append(
                f"no noise floor: the baseline is {base.kind}, not a float model source whose "
                "weights a control could serve"
            )
        gc.collect()
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
    return _finish(cand, base, policy, compared, out_dir, registry, notes, began)


def _divergence(
    base: _SideEval, other: _SideEval, gates: GatesSection, notes: list[str]
) -> DivergenceSummary | None:
    """Next-token KL(base || other) and top-1 agreement over the divergence texts."""
    if base.topk is None or other.topk is None:
        return None
    if base.token_ids != other.token_ids:
        notes.append("KL divergence skipped: the two sides tokenise the text differently")
        return None
    import numpy as np

    pairs = zip(base.topk, other.topk, strict=True)
    kl, agree = zip(*(kl_topk(b, c) for b, c in pairs), strict=True)
    summary = summarize(np.concatenate(kl), np.concatenate(agree), f"topk-{gates.divergence.top_k}")
    wanted = gates.divergence.tokens
    if summary.num_tokens < wanted and gates.divergence.num_texts is None:
        notes.append(
            f"KL measured over {summary.num_tokens:,} tokens, fewer than the {wanted:,} asked "
            "(gates.divergence.tokens): the divergence texts hold no more; give longer texts"
        )
    return summary


def _noise_floor(
    base: _SideEval, control: _SideEval, dtype: str, gates: GatesSection, policy: GatePolicy
) -> NoiseFloor:
    """The control's comparison with the baseline, as the verdict reports it."""
    compared = compare_results(base.results, control.results, policy)
    tasks, ppl = compared.tasks, compared.perplexity
    return NoiseFloor(
        control=describe_control(dtype),
        dtype=dtype,
        divergence=_divergence(base, control, gates, []),
        perplexity_ratio={p.task: p.ratio for p in ppl},
        flip_rate={t.task: t.flip_rate for t in tasks if t.flip_rate is not None},
        loss={t.task: -t.decision.diff for t in tasks},
    )


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
