"""Decision rules: standard errors, the sampling-error rule, flips, policy defaults."""

from __future__ import annotations

import math

import pytest

from kiln.gates.decide.rules import (
    GatePolicy,
    count_flips,
    decide,
    default_policy,
    paired_difference,
    score_stats,
)


def test_stderr_is_the_sample_sd_over_root_n() -> None:
    stats = score_stats([1, 0, 1, 1, 0, 1, 1, 1])
    assert stats.mean == pytest.approx(0.75)
    # sample variance with n-1: 6*(0.25^2) + 2*(0.75^2) = 1.5; / 7 / 8
    assert stats.stderr == pytest.approx(math.sqrt(1.5 / 7 / 8))
    assert score_stats([0.5]).stderr == 0.0


def test_paired_stderr_only_sees_the_items_that_changed() -> None:
    base = [1.0] * 50 + [0.0] * 50
    cand = list(base)
    cand[0] = 0.0  # one right -> wrong flip
    diff = paired_difference(base, cand)
    assert diff.mean == pytest.approx(-0.01)
    # the unpaired stderr would be ~0.07; the paired one only reflects the one flip
    assert diff.stderr == pytest.approx(0.01, abs=1e-3)
    with pytest.raises(ValueError, match="same items"):
        paired_difference(base, cand[:-1])


def test_flips_count_changes_both_ways() -> None:
    flips = count_flips([1, 1, 0, 0, 1], [0, 1, 1, 0, 1])
    assert (flips.right_to_wrong, flips.wrong_to_right, flips.n) == (1, 1, 5)
    assert flips.rate == pytest.approx(0.4)


def test_equal_accuracy_can_hide_many_flips() -> None:
    base = [1, 0] * 50
    cand = [0, 1] * 50
    decision = decide(base, cand, GatePolicy(rule="recovery", recovery_min=0.99))
    assert decision.passed and decision.recovery == 1.0
    assert count_flips(base, cand).rate == 1.0


def test_recovery_rule_uses_the_point_estimate() -> None:
    base = [1.0] * 80 + [0.0] * 20
    cand = [1.0] * 78 + [0.0] * 22
    decision = decide(base, cand, GatePolicy(rule="recovery", recovery_min=0.99))
    assert decision.recovery == pytest.approx(78 / 80)
    assert not decision.passed
    assert decide(base, cand, GatePolicy(rule="recovery", recovery_min=0.97)).passed


def test_noninferiority_needs_a_tight_paired_bound() -> None:
    # 2 net flips out of 1000 items: d = -0.002, se ~ 0.0014, 95% bound ~ -0.0043
    base = [1.0] * 800 + [0.0] * 200
    cand = [0.0, 0.0] + [1.0] * 798 + [0.0] * 200
    tight = decide(base, cand, GatePolicy(rule="noninferior", margin=0.01))
    assert tight.passed and tight.lower_bound > -0.01
    # the same drop rate on 50 items cannot be told apart from a 1-point loss
    small = decide(
        base[:40] + base[800:810],
        cand[:40] + cand[800:810],
        GatePolicy(rule="noninferior", margin=0.01),
    )
    assert not small.passed


def test_default_rule_rescues_a_noisy_point_estimate_with_a_tight_bound() -> None:
    base = [1.0] * 800 + [0.0] * 200
    cand = [0.0] * 10 + [1.0] * 790 + [0.0] * 200  # recovery 0.9875 < 0.99
    recovery_only = decide(base, cand, GatePolicy(rule="recovery", recovery_min=0.99, margin=0.02))
    combined = decide(
        base, cand, GatePolicy(rule="recovery_or_noninferior", recovery_min=0.99, margin=0.02)
    )
    assert not recovery_only.passed
    assert combined.passed  # d = -0.0125, se ~0.0035, bound ~ -0.018 >= -0.02
    assert "lower bound" in combined.explanation


def test_a_real_drop_fails_every_rule() -> None:
    base = [1.0] * 80 + [0.0] * 20
    cand = [0.0] * 15 + [1.0] * 65 + [0.0] * 20  # 15 points lost
    for rule in ("recovery", "noninferior", "recovery_or_noninferior"):
        assert not decide(base, cand, GatePolicy(rule=rule)).passed


def test_lower_is_better_metrics_invert_recovery() -> None:
    decision = decide(
        [10.0, 12.0],
        [10.5, 12.5],
        GatePolicy(rule="recovery", recovery_min=0.95),
        paired=True,
        higher_is_better=False,
    )
    assert decision.recovery == pytest.approx(22 / 23)
    assert decision.diff == pytest.approx(-0.5)


def test_unknown_rule_is_rejected() -> None:
    with pytest.raises(ValueError, match="recovery_or_noninferior"):
        decide([1.0], [1.0], GatePolicy(rule="vibes"))


def test_default_thresholds_follow_the_weight_width() -> None:
    eight, four = default_policy(8), default_policy(4)
    assert eight.recovery_min == 0.99 and four.recovery_min == 0.97
    assert eight.shadow_exact_match_min == 0.90
    # flips are reported, not capped: the paired rule accounts for them
    assert eight.flip_rate_max is None and four.flip_rate_max is None
    assert eight.rule == four.rule == "mcnemar"
    assert (eight.margin, four.margin) == (0.02, 0.03)
