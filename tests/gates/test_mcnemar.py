"""The mcnemar rule: pass, fail or inconclusive with stated error rates, and task power."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kiln.gates.decide.compare import Comparisons, compare_task
from kiln.gates.decide.mcnemar import (
    binary_loss_bounds,
    min_detectable_loss,
    outcome_of,
    paired_loss_bounds,
)
from kiln.gates.decide.rules import GatePolicy, decide
from kiln.gates.decide.verdict import build_verdict

CANDIDATE = {"spec": "a/", "kind": "artifact", "name": "cand", "digest": "c" * 64}
BASELINE = {"spec": "b/", "kind": "source", "name": "base", "digest": "b" * 64}


def paired(n: int, right_to_wrong: int, wrong_to_right: int) -> tuple[list[float], list[float]]:
    """Per-item 0/1 scores on n items with that many flips each way (half right at base)."""
    base = [1.0] * (n // 2) + [0.0] * (n - n // 2)
    cand = list(base)
    for i in range(right_to_wrong):
        cand[i] = 0.0
    for i in range(wrong_to_right):
        cand[n // 2 + i] = 1.0
    return base, cand


def test_p_value_is_the_exact_binomial_tail_of_the_discordant_items() -> None:
    bounds = binary_loss_bounds(9, 2, 200)
    tail = sum(math.comb(11, k) for k in range(9, 12)) / 2**11
    assert bounds.p_value == pytest.approx(tail)
    assert bounds.loss == pytest.approx(7 / 200)
    assert bounds.loss_lower < bounds.loss < bounds.loss_upper


def test_minimum_detectable_loss_at_80_percent_power() -> None:
    # ~140 items at 2% / 5% / 10% flips detect 3 / 4.7 / 6.6 points; 1,000 items 2.5x less
    points = [100 * min_detectable_loss(140, rate) for rate in (0.02, 0.05, 0.10)]
    assert points == pytest.approx([2.97, 4.70, 6.65], abs=0.01)
    assert 100 * min_detectable_loss(1000, 0.05) == pytest.approx(1.76, abs=0.01)


def test_a_loss_beyond_the_margin_fails() -> None:
    base, cand = paired(1000, 60, 10)  # 5 points lost
    decision = decide(base, cand, GatePolicy(rule="mcnemar", margin=0.02), task="kiln_qa")
    assert decision.outcome == "fail" and not decision.passed
    assert decision.loss_lower is not None and decision.loss_lower > 0.02
    assert decision.explanation.startswith("fail on kiln_qa: loss 5.00 points")


def test_no_loss_on_enough_items_passes_despite_many_flips() -> None:
    base, cand = paired(1000, 40, 40)  # 8% of items flip, no net change
    decision = decide(base, cand, GatePolicy(rule="mcnemar", margin=0.02), task="kiln_qa")
    assert decision.outcome == "pass" and decision.passed
    assert decision.loss_upper is not None and decision.loss_upper <= 0.02


def test_the_same_flips_on_a_small_task_are_inconclusive_and_say_what_it_detects() -> None:
    base, cand = paired(140, 4, 3)
    decision = decide(base, cand, GatePolicy(rule="mcnemar", margin=0.02), task="kiln_qa")
    assert decision.outcome == "inconclusive"
    assert decision.explanation.startswith("inconclusive on kiln_qa (140 items detect ≥ 4.70")
    # what inconclusive means is the gate's choice
    assert decision.passed
    strict = decide(base, cand, GatePolicy(rule="mcnemar", margin=0.02, inconclusive="fail"))
    assert strict.outcome == "inconclusive" and not strict.passed
    assert "counted as fail" in strict.explanation


def test_no_flips_on_a_handful_of_items_is_not_evidence() -> None:
    few = binary_loss_bounds(0, 0, 12)
    assert few.loss_upper > 0.2 and outcome_of(few, 0.02) == "inconclusive"
    many = binary_loss_bounds(0, 0, 1000)
    assert many.loss_upper < 0.005 and outcome_of(many, 0.02) == "pass"


def test_a_gain_never_fails() -> None:
    base, cand = paired(200, 0, 30)
    assert decide(base, cand, GatePolicy(rule="mcnemar", margin=0.0)).outcome == "pass"


def test_error_rates_hold_by_simulation() -> None:
    """No true loss: fails at most 5% of the time; a loss just beyond the margin passes at
    most 5% of the time; a loss well beyond it fails most of the time (600 items, margin 2)."""
    rng = np.random.default_rng(7)

    def outcomes(p_loss: float, p_gain: float, n: int = 600, runs: int = 300) -> list[str]:
        draws = rng.multinomial(n, [p_loss, p_gain, 1 - p_loss - p_gain], size=runs)
        return [outcome_of(binary_loss_bounds(int(b), int(c), n), 0.02) for b, c, _ in draws]

    null = outcomes(0.04, 0.04)  # 8% flips, no loss
    assert null.count("fail") / len(null) <= 0.05
    edge = outcomes(0.0525, 0.0275)  # 2.5 points lost
    assert edge.count("pass") / len(edge) <= 0.05
    lossy = outcomes(0.09, 0.03)  # 6 points lost: 4 beyond the margin, above the 3.2 detectable
    assert lossy.count("fail") / len(lossy) > 0.8


def test_scores_that_are_not_0_1_use_paired_normal_bounds() -> None:
    base = [0.5, 0.6, 0.7, 0.8] * 100
    cand = [b - 0.1 for b in base]
    bounds = paired_loss_bounds(base, cand)
    assert bounds.method == "paired-normal" and bounds.loss == pytest.approx(0.1)
    decision = decide(base, cand, GatePolicy(rule="mcnemar", margin=0.02))
    assert decision.method == "paired-normal" and decision.outcome == "fail"


def test_lower_is_better_metrics_count_an_increase_as_a_loss() -> None:
    decision = decide(
        [10.0, 12.0] * 50,
        [11.0, 13.0] * 50,
        GatePolicy(rule="mcnemar", margin=0.5),
        higher_is_better=False,
    )
    assert decision.loss == pytest.approx(1.0) and decision.outcome == "fail"


def test_the_verdict_names_inconclusive_tasks_and_keeps_per_item_scores() -> None:
    policy = GatePolicy()
    base, cand = paired(140, 4, 3)
    task = compare_task(
        "kiln_qa", "exact_match", dict(enumerate(base)), dict(enumerate(cand)), policy
    )
    verdict = build_verdict(CANDIDATE, BASELINE, policy, Comparisons(tasks=[task]))
    assert verdict.passed and task.outcome == "inconclusive"
    data = verdict.to_dict()
    assert data["inconclusive"] == ["kiln_qa: exact_match (mcnemar)"]
    assert data["tasks"][0]["item_scores"]["0"] == [1.0, 0.0]
    assert task.flipped() == {"right_to_wrong": ["0", "1", "2", "3"],
                              "wrong_to_right": ["70", "71", "72"]}  # fmt: skip
    strict = GatePolicy(inconclusive="fail")
    task = compare_task("kiln_qa", "em", dict(enumerate(base)), dict(enumerate(cand)), strict)
    assert not build_verdict(CANDIDATE, BASELINE, strict, Comparisons(tasks=[task])).passed


def test_sides_that_scored_different_items_get_unpaired_bounds() -> None:
    decision = decide(
        [1.0, 0.0] * 100, [1.0, 0.0, 0.0, 0.0] * 50, GatePolicy(rule="mcnemar"), paired=False
    )
    assert decision.method == "unpaired-normal" and not decision.paired
    assert decision.loss == pytest.approx(0.25) and decision.outcome == "fail"
    assert decide([1.0, 0.0, 1.0], [], GatePolicy(rule="mcnemar")).outcome == "inconclusive"
