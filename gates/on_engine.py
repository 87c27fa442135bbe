"""The gate on the engine that ships: both model sides evaluated on a serving engine
(gates/measure/served.py) over its OpenAI API, one side at a time.

Order of work:
1. the candidate artifact served by the engine: the gate's tasks, its top-k prompt
   log-probabilities on the divergence texts, and its answers to the recorded traffic;
   then the engine is stopped;
2. the baseline the same way on the same engine (a float source with the candidate's
   context, on the engine's defaults: `--engine-arg`s are the candidate's serving
   configuration under test, so a configuration that damages answers shows as a loss), or as
   it is where it is an endpoint URL; with `--engine URL` (a deployment kiln did not start) a
   model baseline is evaluated in process, as `kiln` would, and the notes say the sides ran
   on different engines;
3. the comparisons of the `kiln` path (tasks, perplexity, KL, shadow), plus every check the
   engine could not answer, named as not measured (it fails the gate);
4. with `gates.engine_vs_runtime`, the candidate scored by kiln's runtime in process too:
   per task the items whose score the engine changed, the perplexity ratio, and the KL of
   the engine's next-token distributions from the runtime's (reported, not gated).

Both sides are tokenised locally with the candidate's tokenizer (HttpLM), so items are the
same token ids on every engine. No noise floor (its control is kiln's runtime), and the
engine-served baseline is not cached: it is evaluated again each run.
"""

from __future__ import annotations

import gc
import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kiln.gates.decide.compare import KL_CHECK, Comparisons, Unmeasured, compare_results
from kiln.gates.decide.rules import GatePolicy
from kiln.gates.evaluate import (
    SideEval,
    divergence,
    evaluate_baseline,
    evaluate_side,
    gated_divergence,
    task_dirs,
)
from kiln.gates.measure.divergence_texts import divergence_ids, divergence_texts
from kiln.gates.measure.http_lm import HttpLM, NotMeasured
from kiln.gates.measure.noise_floor import engine_dtype
from kiln.gates.measure.replay import ReplaySettings, replay, replay_requests
from kiln.gates.measure.replay_cache import CachedSide
from kiln.gates.measure.served import (
    URL_ENGINE,
    EngineChoice,
    Served,
    ServeSettings,
    serve_side,
    settings_for,
)
from kiln.gates.measure.shadow_step import Progress
from kiln.gates.measure.sides import HttpSide, SideSpec
from kiln.gates.measure.tasks import run_measurable_tasks
from kiln.gates.settings import GatesSection
from kiln.runtime.base.errors import UsageError
from kiln.runtime.base.machine import machine_facts
from kiln.runtime.formats.artifact import MODEL_DIR
from kiln.runtime.formats.traffic import TrafficRecord

PROBE_TEXT = "The capital of France is Paris, and the capital of Italy is"


@dataclass(slots=True)
class Traffic:
    """The recorded requests replayed through both sides, and how."""

    records: list[TrafficRecord]
    settings: ReplaySettings
    timeout_s: float


@dataclass(slots=True)
class ServedEval:
    """One side's evaluation on an engine: its scores, what it could not answer, its
    answers to the traffic (gathered while it was up) and the engine's record."""

    evaluated: SideEval
    unmeasured: list[Unmeasured]
    answers: CachedSide | None
    record: dict[str, Any]


def _tokenizer(side: SideSpec) -> Any:
    from transformers import AutoTokenizer

    assert side.path is not None
    model_dir = side.path / MODEL_DIR if side.kind == "artifact" else side.path
    return AutoTokenizer.from_pretrained(str(model_dir))


def _vocab_size(side: SideSpec) -> int | None:
    """The model's vocabulary rows (config.json), which a padded vocabulary makes more than
    the tokenizer's: the token ids an engine's answer may name."""
    assert side.path is not None
    try:
        config = json.loads((side.path / MODEL_DIR / "config.json").read_text())
    except (OSError, ValueError):
        return None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    size = text.get("vocab_size")
    return size if isinstance(size, int) else None


def evaluate_served(
    served: Served,
    tokenizer: Any,
    vocab_size: int | None,
    gates: GatesSection,
    texts: list[str],
    base_dir: Path,
    traffic: Traffic | None,
    name: str,
) -> ServedEval:
    """Tasks (one at a time, so one the engine refuses fails alone), top-k logprobs and the
    traffic's answers of one served side."""
    lm = HttpLM(served, tokenizer, vocab_size=vocab_size)
    label = served.label
    unmeasured: list[Unmeasured] = []
    results = {}

    def unmeasurable(kind: str) -> str | None:
        return None if kind == "generate_until" else served.capabilities.missing("scores")

    try:
        for task in gates.tasks:
            try:
                got, skipped = run_measurable_tasks(
                    lm, [task], task_dirs(gates, base_dir), gates.limit,
                    gates.num_fewshot or None, unmeasurable,
                )  # fmt: skip
            except NotMeasured as exc:
                unmeasured.append(Unmeasured(task, label, exc.reason))
                continue
            except OverflowError:  # finite log-probabilities whose sum no float holds
                why = "its log-probabilities make a perplexity beyond floating point"
                unmeasured.append(Unmeasured(task, label, why))
                continue
            results.update(got)
            unmeasured += [Unmeasured(t, label, why) for t, why in skipped.items()]
        topk = ids = None
        if gates.divergence.enabled and texts:
            ids = divergence_ids(
                texts, lm.tok_encode, gates.divergence.tokens, gates.divergence.max_seq_len
            )
            try:
                topk, inconsistent = lm.checked_topk(ids, gates.divergence.top_k)
            except NotMeasured as exc:
                unmeasured.append(Unmeasured(KL_CHECK, label, exc.reason))
                topk, ids, inconsistent = None, None, None
            if inconsistent is not None:  # neither its scores nor its top-k can be trusted
                scored = [t for t, r in results.items() if r.output_type != "generate_until"]
                unmeasured += [Unmeasured(t, label, inconsistent) for t in [*scored, KL_CHECK]]
                results = {t: r for t, r in results.items() if t not in scored}
                topk = ids = None
    finally:
        lm.close()
    answers = None
    if traffic is not None:
        side = HttpSide(served.url, served.model, traffic.timeout_s, served.api_key)
        answers = CachedSide(name, lambda: side)
        for record in replay_requests(traffic.records, traffic.settings):
            answers.complete(record)
        side.close()
    return ServedEval(SideEval(results, topk, ids), unmeasured, answers, served.describe())


def _on_engine(
    choice: EngineChoice,
    side: SideSpec,
    role: str,
    settings: ServeSettings,
    run: Callable[[Served], ServedEval],
    log_dir: Path,
    probe: list[int],
) -> ServedEval:
    with serve_side(choice, side, settings, log_dir, role, probe) as served:
        return run(served)


def _engine_vs_runtime(
    cand: SideSpec, on_engine: SideEval, gates: GatesSection, base_dir: Path, texts: list[str]
) -> dict[str, Any]:
    """The candidate scored by kiln's runtime in process against the same on the engine."""
    runtime, _ = evaluate_side(cand, gates, texts, None, base_dir)
    dtype = engine_dtype(runtime.engine) if runtime.engine is not None else "auto"
    runtime.engine = None
    gc.collect()
    tasks: dict[str, Any] = {}
    perplexity: dict[str, Any] = {}
    for name, mine in on_engine.results.items():
        theirs = runtime.results.get(name)
        if theirs is None:
            continue
        if mine.is_perplexity:
            ratio = mine.value / theirs.value if theirs.value else None
            perplexity[name] = {"runtime": theirs.value, "engine": mine.value, "ratio": ratio}
            continue
        shared = sorted(set(mine.per_item) & set(theirs.per_item))
        changed = [i for i in shared if mine.per_item[i] != theirs.per_item[i]]
        tasks[name] = {"metric": mine.metric, "runtime": theirs.value, "engine": mine.value,
                       "items": len(shared), "items_changed": len(changed),
                       "agreement": 1 - len(changed) / len(shared) if shared else None}  # fmt: skip
    try:
        kl = divergence(runtime, on_engine, gates, [])
    except NotMeasured:
        kl = None
    return {
        "runtime": f"kiln's runtime in process ({dtype})",
        "tasks": tasks,
        "perplexity": perplexity,
        "divergence": kl.to_dict() if kl else None,
    }


def compare_on_engine(
    cand: SideSpec,
    base: SideSpec,
    gates: GatesSection,
    policy: GatePolicy,
    choice: EngineChoice,
    base_dir: Path,
    log_dir: Path,
    traffic: Traffic | None,
    say: Progress,
    notes: list[str],
) -> Comparisons:
    """Both sides on `choice`, compared (module docstring)."""
    if cand.kind != "artifact":
        raise UsageError(
            f"--engine {choice.label}: the candidate {cand.spec} must be the artifact the engine "
            "serves (its tokenizer scores the items)"
        )
    texts = (
        divergence_texts(gates.divergence.texts, gates.divergence.num_texts, base_dir)
        if gates.divergence.enabled
        else []
    )
    tokenizer = _tokenizer(cand)
    vocab_size = _vocab_size(cand)
    probe = list(tokenizer.encode(PROBE_TEXT))
    top_k = gates.divergence.top_k
    cand_settings = settings_for(cand, None, top_k)

    def run(name: str) -> Callable[[Served], ServedEval]:
        return lambda served: evaluate_served(
            served, tokenizer, vocab_size, gates, texts, base_dir, traffic, name
        )

    say(f"candidate: on {choice.label}")
    c = _on_engine(choice, cand, "candidate", cand_settings, run(cand.name), log_dir, probe)
    engines: dict[str, Any] = {"candidate": c.record, "machine": machine_facts()}
    if c.record.get("identity", "").startswith("named"):
        notes.append(f"the candidate's model on {choice.label} was {c.record['identity']}")
    unmeasured = list(c.unmeasured)
    b_answers: Any = None
    if base.kind == "http" or choice.name != URL_ENGINE:
        # The engine arguments are the candidate's serving configuration under test; the
        # baseline is served by the engine's defaults (with the same context).
        on = EngineChoice(URL_ENGINE, base.url, timeout_s=choice.timeout_s) if (
            base.kind == "http") else replace(choice, args=())  # fmt: skip
        say(f"baseline: on {on.label}")
        b = _on_engine(on, base, "baseline", settings_for(base, cand_settings, top_k),
                       run(base.name), log_dir, probe)  # fmt: skip
        b_eval, b_answers = b.evaluated, b.answers
        engines["baseline"] = b.record
        unmeasured += b.unmeasured
    else:
        say(f"baseline: {', '.join(gates.tasks) or 'no tasks'} in process ({base.kind})")
        max_length = min(2048, (c.record.get("max_model_len") or 2050) - 2)
        b_eval, _ = evaluate_baseline(base, gates, texts, max_length, base_dir, say, None)
        engines["baseline"] = {"engine": "kiln" if base.kind == "artifact" else "transformers"}
        notes.append(
            f"the candidate ran on {choice.label}, the baseline in process: the difference "
            "includes the engines', not only the quantisation's"
        )
        if traffic is not None:
            notes.append("shadow: not replayed, the baseline has no server to answer it")
            traffic = None
    gone = {u.check for u in unmeasured}
    measured = {k: v for k, v in c.evaluated.results.items() if k not in gone}
    compared = compare_results(
        {k: v for k, v in b_eval.results.items() if k in measured}, measured, policy
    )
    gated_divergence(compared, b_eval, c.evaluated, gates, notes, choice.label)
    compared.unmeasured = _one_per_check([*unmeasured, *compared.unmeasured])
    compared.engines = engines
    if traffic is not None and c.answers is not None and b_answers is not None:
        say(f"replay: {len(traffic.records)} recorded requests, both sides' answers")
        compared.shadow = replay(traffic.records, b_answers, c.answers, traffic.settings)
    if gates.noise_floor != "off":
        notes.append(f"no noise floor on {choice.label}: its control is kiln's runtime's; "
                     "the engine-vs-runtime section shows what the engine changes")  # fmt: skip
    if gates.engine_vs_runtime and choice.name != "kiln":
        say("candidate: in process on kiln's runtime too (engine vs runtime)")
        try:
            compared.engine_vs_runtime = _engine_vs_runtime(cand, c.evaluated, gates,
                                                            base_dir, texts)  # fmt: skip
        except UsageError as exc:
            notes.append(f"engine vs runtime: not measured, kiln's runtime cannot load "
                         f"{cand.spec} ({exc.message})")  # fmt: skip
    return compared


def _one_per_check(found: list[Unmeasured]) -> list[Unmeasured]:
    """One entry per check (a check both sides missed is named once, with both reasons)."""
    merged: dict[str, Unmeasured] = {}
    for item in found:
        seen = merged.get(item.check)
        if seen is None:
            merged[item.check] = Unmeasured(item.check, item.engine, item.reason)
        elif item.reason not in seen.reason:
            seen.reason = f"{seen.reason}; {item.reason}"
    return list(merged.values())
