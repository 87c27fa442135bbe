"""The verdict: task comparisons, divergence, checks, and gate.json."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from kiln.gates.decide.compare import Comparisons, PerplexityComparison, compare_task
from kiln.gates.decide.rules import GatePolicy
from kiln.gates.decide.verdict import GateVerdict, build_verdict
from kiln.gates.measure.divergence import kl_dense, kl_topk, summarize

CANDIDATE = {"spec": "a/", "kind": "artifact", "name": "cand", "digest": "c" * 64}
BASELINE = {"spec": "b/", "kind": "source", "name": "base", "digest": "b" * 64}
# The two-way rule of published practice (llm-compressor's recovery, a 5% flip cap).
TWO_WAY = GatePolicy(rule="recovery_or_noninferior", flip_rate_max=0.05)


def scores(correct: list[int]) -> dict[int, float]:
    return {i: float(c) for i, c in enumerate(correct)}


def test_a_candidate_that_keeps_its_answers_passes(tmp_path: Path) -> None:
    base = scores([1] * 70 + [0] * 30)
    cand = scores([1] * 70 + [0] * 29 + [1])  # one wrong -> right flip
    policy = TWO_WAY
    task = compare_task("kiln_mc", "acc", base, cand, policy)
    assert task.recovery == pytest.approx(71 / 70)
    assert (task.right_to_wrong, task.wrong_to_right, task.flip_rate) == (0, 1, 0.01)
    verdict = build_verdict(
        CANDIDATE,
        BASELINE,
        policy,
        Comparisons(
            tasks=[task],
            perplexity=[PerplexityComparison("kiln_ppl", "word_perplexity", 20.0, 20.4)],
        ),
        tools={"lm-eval": "0.4.13"},
    )
    assert verdict.passed, [c for c in verdict.failed_checks]
    path = verdict.write(tmp_path)
    data = json.loads(path.read_text())
    assert data["passed"] is True
    assert data["candidate"]["digest"] == "c" * 64 and data["baseline"]["digest"] == "b" * 64
    assert data["tools"] == {"lm-eval": "0.4.13"}
    assert data["policy"]["recovery_min"] == 0.99
    assert data["perplexity"][0]["ratio"] == pytest.approx(1.02)
    (mc,) = data["tasks"]
    assert mc["decision"]["rule"] == "recovery_or_noninferior"
    assert mc["decision"]["lower_bound"] < mc["decision"]["diff"]
    names = [c["name"] for c in data["checks"]]
    assert names == [
        "kiln_mc: acc (recovery_or_noninferior)",
        "kiln_mc: flip rate",
        "kiln_ppl: word_perplexity ratio",
    ]


def test_a_candidate_that_drops_accuracy_fails_and_says_why() -> None:
    base = scores([1] * 70 + [0] * 30)
    cand = scores([0] * 10 + [1] * 60 + [0] * 30)
    verdict = build_verdict(
        CANDIDATE,
        BASELINE,
        TWO_WAY,
        Comparisons(tasks=[compare_task("qa", "em", base, cand, TWO_WAY)]),
    )
    assert not verdict.passed
    failed = {c.name: c for c in verdict.failed_checks}
    assert set(failed) == {"qa: em (recovery_or_noninferior)", "qa: flip rate"}
    assert failed["qa: flip rate"].value == pytest.approx(0.10)
    assert "recovery 0.8571 < 0.99" in failed["qa: em (recovery_or_noninferior)"].detail


def test_equal_accuracy_with_many_flips_still_fails_on_flip_rate() -> None:
    base = scores([1, 0] * 50)
    cand = scores([0, 1] * 50)
    verdict = build_verdict(
        CANDIDATE,
        BASELINE,
        TWO_WAY,
        Comparisons(tasks=[compare_task("mc", "acc", base, cand, TWO_WAY)]),
    )
    assert [c.name for c in verdict.failed_checks] == ["mc: flip rate"]


def test_sides_that_scored_different_items_are_compared_unpaired() -> None:
    task = compare_task("mc", "acc", scores([1, 0, 1, 1]), {10: 1.0, 11: 1.0}, GatePolicy())
    assert not task.decision.paired and task.flip_rate is None


def test_a_perplexity_increase_beyond_the_limit_fails() -> None:
    ppl = PerplexityComparison("kiln_ppl", "word_perplexity", 20.0, 25.0)
    verdict = build_verdict(CANDIDATE, BASELINE, GatePolicy(), Comparisons(perplexity=[ppl]))
    assert not verdict.passed and verdict.checks[0].value == pytest.approx(1.25)


def test_nothing_measured_cannot_pass() -> None:
    with pytest.raises(ValueError, match="nothing measured"):
        build_verdict(CANDIDATE, BASELINE, GatePolicy(), Comparisons())


def test_gate_json_round_trips_and_has_no_nan(tmp_path: Path) -> None:
    task = compare_task("mc", "acc", scores([0, 0]), scores([0, 0]), GatePolicy())
    verdict = build_verdict(CANDIDATE, BASELINE, GatePolicy(), Comparisons(tasks=[task]))
    text = verdict.write(tmp_path).read_text()
    assert "NaN" not in text and "Infinity" not in text
    again = GateVerdict.from_dict(json.loads(text))
    assert again.to_dict() == verdict.to_dict()


def test_dense_kl_matches_the_definition() -> None:
    p = np.log(np.array([[0.5, 0.25, 0.25], [0.9, 0.05, 0.05]]))
    q = np.log(np.array([[0.25, 0.5, 0.25], [0.9, 0.05, 0.05]]))
    kl, agree = kl_dense(p, q)
    assert kl[0] == pytest.approx(0.5 * math.log(2) + 0.25 * math.log(0.5))
    assert kl[1] == pytest.approx(0.0, abs=1e-12)
    assert agree.tolist() == [False, True]


def test_topk_kl_is_a_lower_bound_of_the_dense_kl() -> None:
    rng = np.random.default_rng(0)
    logits_p = rng.normal(size=(50, 200)) * 3
    logits_q = logits_p + rng.normal(size=(50, 200)) * 0.5
    dense, _ = kl_dense(logits_p, logits_q)
    log_p = logits_p - np.log(np.exp(logits_p).sum(-1, keepdims=True))
    log_q = logits_q - np.log(np.exp(logits_q).sum(-1, keepdims=True))

    def top(log: np.ndarray, k: int) -> list[dict[int, float]]:
        return [{int(t): float(row[t]) for t in np.argsort(-row)[:k]} for row in log]

    approx, agree = kl_topk(top(log_p, 20), top(log_q, 20))
    assert np.all(approx <= dense + 1e-9)
    assert approx.mean() > 0.5 * dense.mean()  # the top 20 of 200 carry most of the mass
    assert agree.mean() == pytest.approx((log_p.argmax(-1) == log_q.argmax(-1)).mean())
    summary = summarize(approx, agree, "topk-20")
    assert summary.num_tokens == 50 and sum(b["count"] for b in summary.histogram) == 50
    assert summary.kl_p99 <= summary.kl_max


def test_flips_are_checked_against_the_controls_and_the_floor_is_reported(
    tmp_path: Path,
) -> None:
    from kiln.gates.measure.noise_floor import NoiseFloor
    from kiln.gates.report.markdown import to_markdown

    floor = NoiseFloor(
        "the baseline's weights rounded to bfloat16",
        "bfloat16",
        summarize(np.array([1e-5, 3e-5]), np.array([True, True]), "topk-20"),
        perplexity_ratio={"kiln_ppl": 1.001},
        flip_rate={"qa": 0.02},
    )
    policy = GatePolicy(flip_rate_excess_max=0.05)
    base = scores([1] * 50 + [0] * 50)
    cand = scores([0] * 5 + [1] * 45 + [1] * 5 + [0] * 45)  # 10% flips, no net loss
    kl = summarize(np.array([0.01, 0.03]), np.array([True, False]), "topk-20")
    verdict = build_verdict(
        CANDIDATE,
        BASELINE,
        policy,
        Comparisons(
            tasks=[compare_task("qa", "em", base, cand, policy)], divergence=kl, noise_floor=floor
        ),
    )
    excess = next(c for c in verdict.checks if c.name == "qa: flip rate over the control")
    assert excess.value == pytest.approx(0.08) and not excess.passed
    assert excess.detail.startswith("flips 10.0%, control 2.0%")
    kl_check = next(c for c in verdict.checks if c.name == "KL divergence mean")
    assert kl_check.detail == "1000× the control's 2e-05"
    assert "noise floor: the baseline's weights rounded to bfloat16; KL mean 0.00002" in (
        to_markdown(verdict)
    )
    again = GateVerdict.from_dict(json.loads(verdict.write(tmp_path).read_text()))
    assert again.noise_floor == floor and again.to_dict() == verdict.to_dict()
