"""Evaluating the gate's model sides: lm-eval tasks and top-k next-token log-probabilities
through one loaded model at a time (kiln's runtime for an artifact, transformers for a float
source), the baseline's and its control's from the evaluation cache where it holds them,
and the divergence and noise floor computed from them."""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.gates.decide.compare import KL_CHECK, Comparisons, Unmeasured, compare_results
from kiln.gates.decide.rules import GatePolicy
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
from kiln.gates.measure.openai_answers import NotMeasured
from kiln.gates.measure.shadow_step import Progress
from kiln.gates.measure.sides import SideSpec
from kiln.gates.measure.tasks import BUILTIN_TASKS_DIR, TaskResult
from kiln.gates.settings import GatesSection
from kiln.runtime.base.versions import GATE_TOOLS, versions


@dataclass(slots=True)
class SideEval:
    results: dict[str, TaskResult]
    topk: list[list[dict[int, float]]] | None
    token_ids: list[list[int]] | None
    engine: Any = None


def task_dirs(gates: GatesSection, base_dir: Path) -> list[Path]:
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
) -> SideEval:
    """lm-eval tasks and top-k logprobs on the divergence texts, through one loaded model."""
    from kiln.gates.measure.tasks import run_tasks

    results = {}
    if gates.tasks:  # a gate of distribution checks only runs no lm-eval task
        results = run_tasks(
            lm, gates.tasks, task_dirs(gates, base_dir), gates.limit, gates.num_fewshot or None
        )
    topk = ids = None
    if gates.divergence.enabled and texts:
        ids = divergence_ids(
            texts, lm.tok_encode, gates.divergence.tokens, gates.divergence.max_seq_len
        )
        topk = topk_fn(ids, gates.divergence.top_k)
    return SideEval(results, topk, ids)


def evaluate_side(
    side: SideSpec, gates: GatesSection, texts: list[str], max_length: int | None, base_dir: Path
) -> tuple[SideEval, int]:
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
        p for d in task_dirs(gates, base_dir) if d.is_dir() for p in d.iterdir() if p.is_file()
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


def evaluate_baseline(
    side: SideSpec,
    gates: GatesSection,
    texts: list[str],
    max_length: int,
    base_dir: Path,
    say: Progress,
    control: str | None,
) -> tuple[SideEval, SideEval | None]:
    """The baseline's evaluation and, when `control` names a compute dtype, its control's
    (the baseline served by the runtime in that dtype: the noise floor), each from the
    evaluation cache when it holds them."""
    # The role names how the control was computed, so a control cached by another method
    # (or in another dtype) is never taken for this one.
    roles = {"baseline": None} | ({f"control-runtime-{control}": control} if control else {})
    cache = EvaluationCache() if gates.baseline_cache else None
    keys = {r: _evaluation_key(side, r, gates, texts, max_length, base_dir) for r in roles}
    found: dict[str, SideEval] = {}
    for role in roles:
        data = cache.get(keys[role]) if cache else None
        if data is not None:
            found[role] = SideEval(*decode(data))
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


def divergence(
    base: SideEval, other: SideEval, gates: GatesSection, notes: list[str]
) -> DivergenceSummary | None:
    """Next-token KL(base || other) and top-1 agreement over the divergence texts; None where
    a side measured none (the divergence is off, or its engine's miss is recorded already),
    NotMeasured where the two sides' numbers cannot be compared."""
    if base.topk is None or other.topk is None:
        return None
    if base.token_ids != other.token_ids:
        raise NotMeasured(
            "the two sides tokenise the divergence texts differently, so their next-token "
            "distributions are not over the same positions"
        )
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


def gated_divergence(
    compared: Comparisons,
    base: SideEval,
    other: SideEval,
    gates: GatesSection,
    notes: list[str],
    engine: str,
) -> None:
    """The divergence into `compared`, or, where it cannot be computed, the KL check named
    as not measured on `engine` (which fails the gate)."""
    try:
        compared.divergence = divergence(base, other, gates, notes)
    except NotMeasured as exc:
        compared.unmeasured.append(Unmeasured(KL_CHECK, engine, exc.reason))


def noise_floor(
    base: SideEval, control: SideEval, dtype: str, gates: GatesSection, policy: GatePolicy
) -> NoiseFloor:
    """The control's comparison with the baseline, as the verdict reports it."""
    compared = compare_results(base.results, control.results, policy)
    tasks, ppl = compared.tasks, compared.perplexity
    try:
        floor_kl = divergence(base, control, gates, [])
    except NotMeasured:
        floor_kl = None  # the control is reported without one; the candidate's is gated
    return NoiseFloor(
        control=describe_control(dtype),
        dtype=dtype,
        divergence=floor_kl,
        perplexity_ratio={p.task: p.ratio for p in ppl},
        flip_rate={t.task: t.flip_rate for t in tasks if t.flip_rate is not None},
        loss={t.task: -t.decision.diff for t in tasks},
    )


def compare_models(
    cand: SideSpec,
    base: SideSpec,
    gates: GatesSection,
    policy: GatePolicy,
    base_dir: Path,
    say: Progress,
    notes: list[str],
) -> tuple[Comparisons, tuple[Any, Any]]:
    """Both model sides through the tasks and the divergence texts (and the baseline's
    control, where it has one), compared; with the engines loaded, for the shadow step."""
    texts = (
        divergence_texts(gates.divergence.texts, gates.divergence.num_texts, base_dir)
        if gates.divergence.enabled
        else []
    )
    say(f"candidate: {', '.join(gates.tasks) or 'no tasks'} through the runtime")
    c_eval, max_length = evaluate_side(cand, gates, texts, None, base_dir)
    cand_engine = c_eval.engine
    control = None
    if base.kind == "source" and gates.noise_floor != "off":
        control = control_dtype(gates.noise_floor, cand_engine)
    b_eval, ctrl_eval = evaluate_baseline(base, gates, texts, max_length, base_dir, say, control)
    base_engine = b_eval.engine
    compared = compare_results(b_eval.results, c_eval.results, policy)
    gated_divergence(compared, b_eval, c_eval, gates, notes, "kiln (in process)")
    if ctrl_eval is not None and control is not None:
        compared.noise_floor = noise_floor(b_eval, ctrl_eval, control, gates, policy)
    elif gates.noise_floor != "off":
        notes.append(
            f"no noise floor: the baseline is {base.kind}, not a float model source whose "
            "weights a control could serve"
        )
    gc.collect()
    return compared, (cand_engine, base_engine)
