"""Decision rules of the gate: sampling error, flips, and the pass/fail rule of one task.

A score difference between two models on a few hundred items is noisy, so every task
comparison carries standard errors and the decision rule can account for them.

Rules (``DecisionRule``), for a higher-is-better metric with per-item scores b_i (baseline)
and c_i (candidate) on the same n items:

- ``mcnemar`` (default): three outcomes with stated error rates (`gates.mcnemar`): FAIL on
  evidence of a loss beyond `margin` (exact one-sided McNemar bounds on the discordant
  items), PASS when the evidence rules out such a loss, else INCONCLUSIVE, reported with
  the loss the task's items can detect. The policy's `inconclusive` says what that counts
  as: "pass" (default: the task could not show a loss, the distribution checks decide) or
  "fail" (every task must prove itself).
- ``recovery``: pass iff  recovery = mean(c) / mean(b) >= recovery_threshold
  (llm-compressor's CI shape; the point estimate only).
- ``noninferior``: let d_i = c_i - b_i, d = mean(d_i), se = sd(d_i) / sqrt(n) (sample sd,
  n - 1). Pass iff the one-sided lower confidence bound  d - z * se >= -margin, where
  z = Phi^-1(confidence) (1.645 at 0.95) and margin is in the metric's own units
  (0.02 = two points of accuracy). This proves, at that confidence, that the candidate is
  at most `margin` worse; it needs enough items for se to be small.
- ``recovery_or_noninferior``: pass iff either rule passes. The paired bound
  rescues a point estimate that dips under the threshold by noise when the paired test is
  tight (few flips), and a recovery above threshold is never failed for being noisy.

When the two sides did not score the same items, the paired difference is unavailable and
the unpaired stderr sqrt(se_b^2 + se_c^2) is used instead. Standard normal quantiles come
from the standard library (`statistics.NormalDist`); the exact binomial bounds of the
mcnemar rule from scipy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

from kiln.gates.decide.mcnemar import (
    DEFAULT_POWER,
    binary_loss_bounds,
    explain,
    outcome_of,
    paired_loss_bounds,
    unpaired_loss_bounds,
)

DecisionRule = Literal["mcnemar", "recovery", "noninferior", "recovery_or_noninferior"]
DECISION_RULES: tuple[str, ...] = ("mcnemar", "recovery", "noninferior", "recovery_or_noninferior")
Inconclusive = Literal["pass", "fail"]


@dataclass(slots=True)
class ScoreStats:
    """Mean and standard error of the mean of per-item scores."""

    mean: float
    stderr: float
    n: int


def score_stats(scores: Sequence[float]) -> ScoreStats:
    """Mean and stderr (sample sd / sqrt(n)); stderr is 0 for fewer than two items."""
    n = len(scores)
    if n == 0:
        return ScoreStats(math.nan, math.nan, 0)
    mean = math.fsum(scores) / n
    if n < 2:
        return ScoreStats(mean, 0.0, n)
    var = math.fsum((s - mean) ** 2 for s in scores) / (n - 1)
    return ScoreStats(mean, math.sqrt(var / n), n)


def paired_difference(baseline: Sequence[float], candidate: Sequence[float]) -> ScoreStats:
    """Mean and stderr of candidate - baseline over the same items (same order)."""
    if len(baseline) != len(candidate):
        raise ValueError(
            f"paired scores need the same items: {len(baseline)} baseline vs "
            f"{len(candidate)} candidate"
        )
    return score_stats([c - b for b, c in zip(baseline, candidate, strict=True)])


@dataclass(slots=True)
class Flips:
    """Items whose correctness changed between baseline and candidate (arXiv 2407.09141)."""

    right_to_wrong: int
    wrong_to_right: int
    n: int

    @property
    def rate(self) -> float:
        """Share of items that flipped either way."""
        return (self.right_to_wrong + self.wrong_to_right) / self.n if self.n else 0.0


def count_flips(
    baseline: Sequence[float], candidate: Sequence[float], correct_at: float = 0.5
) -> Flips:
    """Count flips of per-item correctness (score >= correct_at counts as right)."""
    if len(baseline) != len(candidate):
        raise ValueError("flips need the same items on both sides")
    r2w = sum(1 for b, c in zip(baseline, candidate, strict=True) if b >= correct_at > c)
    w2r = sum(1 for b, c in zip(baseline, candidate, strict=True) if c >= correct_at > b)
    return Flips(r2w, w2r, len(baseline))


@dataclass(slots=True)
class Decision:
    """The outcome of one task's decision rule, with every number it used."""

    rule: str
    passed: bool
    recovery: float
    recovery_threshold: float
    diff: float
    diff_stderr: float
    paired: bool
    lower_bound: float
    margin: float
    confidence: float
    explanation: str
    # The mcnemar rule's numbers (gate.json fields added for it; None under the other rules).
    outcome: str = ""  # "pass", "fail" or "inconclusive"
    method: str = ""
    loss: float | None = None
    loss_lower: float | None = None
    loss_upper: float | None = None
    p_value: float | None = None
    min_detectable_loss: float | None = None
    power: float | None = None


def recovery_of(baseline: float, candidate: float, higher_is_better: bool = True) -> float:
    """candidate / baseline for higher-is-better metrics, baseline / candidate otherwise."""
    num, den = (candidate, baseline) if higher_is_better else (baseline, candidate)
    if den == 0:
        return 1.0 if num == 0 else math.inf
    return num / den


def decide(
    baseline: Sequence[float],
    candidate: Sequence[float],
    policy: GatePolicy,
    *,
    paired: bool = True,
    higher_is_better: bool = True,
    task: str = "task",
) -> Decision:
    """Apply the policy's decision rule to per-item scores of both sides (see the module
    docstring): its rule, recovery threshold, margin, confidence, inconclusive and power."""
    rule, recovery_threshold = policy.rule, policy.recovery_min
    margin, confidence = policy.margin, policy.confidence
    if rule not in DECISION_RULES:
        raise ValueError(f"decision rule {rule!r} is not one of {', '.join(DECISION_RULES)}")
    if not 0.5 <= confidence < 1:
        raise ValueError(f"confidence {confidence} must be in [0.5, 1)")
    if rule == "mcnemar":
        return _decide_mcnemar(baseline, candidate, policy, paired, higher_is_better, task)
    base, cand = score_stats(baseline), score_stats(candidate)
    sign = 1.0 if higher_is_better else -1.0
    paired = paired and len(baseline) == len(candidate) and len(baseline) > 0
    if paired:
        d = paired_difference(baseline, candidate)
        diff, se = sign * d.mean, d.stderr
    else:
        diff = sign * (cand.mean - base.mean)
        se = math.sqrt(base.stderr**2 + cand.stderr**2)
    z = NormalDist().inv_cdf(confidence)
    lower = diff - z * se
    recovery = recovery_of(base.mean, cand.mean, higher_is_better)
    by_recovery = recovery >= recovery_threshold
    by_bound = lower >= -margin
    passed = {
        "recovery": by_recovery,
        "noninferior": by_bound,
        "recovery_or_noninferior": by_recovery or by_bound,
    }[rule]
    explanation = (
        f"recovery {recovery:.4f} {'>=' if by_recovery else '<'} {recovery_threshold}; "
        f"{'paired' if paired else 'unpaired'} difference {diff:+.4f} ± {se:.4f}, "
        f"{confidence:.0%} lower bound {lower:+.4f} {'>=' if by_bound else '<'} {-margin:+.4f}"
    )
    return Decision(
        rule=rule,
        passed=passed,
        recovery=recovery,
        recovery_threshold=recovery_threshold,
        diff=diff,
        diff_stderr=se,
        paired=paired,
        lower_bound=lower,
        margin=margin,
        confidence=confidence,
        explanation=explanation,
    )


def _decide_mcnemar(
    baseline: Sequence[float],
    candidate: Sequence[float],
    policy: GatePolicy,
    paired: bool,
    higher_is_better: bool,
    task: str,
) -> Decision:
    """The three-outcome rule: exact McNemar for 0/1 scores, paired normal bounds otherwise."""
    margin, confidence, power = policy.margin, policy.confidence, policy.power
    inconclusive = policy.inconclusive
    if inconclusive not in ("pass", "fail"):
        raise ValueError(f"inconclusive must be 'pass' or 'fail', not {inconclusive!r}")
    sign = 1.0 if higher_is_better else -1.0
    base = [sign * b for b in baseline]
    cand = [sign * c for c in candidate]
    paired = paired and len(base) == len(cand) and len(base) > 0
    binary = all(v in (0.0, 1.0) for v in (*baseline, *candidate))
    if paired and binary and higher_is_better:
        flips = count_flips(base, cand)
        bounds = binary_loss_bounds(
            flips.right_to_wrong, flips.wrong_to_right, flips.n, confidence, power
        )
        scale = 100.0
    elif paired:
        bounds = paired_loss_bounds(base, cand, confidence, power)
        scale = 100.0 if binary else 1.0
    else:
        bounds = unpaired_loss_bounds(base, cand, confidence, power)
        scale = 100.0 if binary else 1.0
    outcome = outcome_of(bounds, margin)
    explanation = explain(task, bounds, margin, confidence, scale)
    if outcome == "inconclusive":
        explanation += f"; counted as {inconclusive} (gates.inconclusive)"
    stats = score_stats(baseline), score_stats(candidate)
    if paired:
        se = paired_difference(baseline, candidate).stderr
    else:
        se = math.sqrt(stats[0].stderr ** 2 + stats[1].stderr ** 2)
    return Decision(
        rule="mcnemar",
        passed=outcome == "pass" or (outcome == "inconclusive" and inconclusive == "pass"),
        recovery=recovery_of(stats[0].mean, stats[1].mean, higher_is_better),
        recovery_threshold=policy.recovery_min,
        diff=-bounds.loss,
        diff_stderr=se,
        paired=paired,
        lower_bound=-bounds.loss_upper,
        margin=margin,
        confidence=confidence,
        explanation=explanation,
        outcome=outcome,
        method=bounds.method,
        loss=bounds.loss,
        loss_lower=bounds.loss_lower,
        loss_upper=bounds.loss_upper,
        p_value=bounds.p_value,
        min_detectable_loss=bounds.min_detectable_loss,
        power=power,
    )


@dataclass(slots=True)
class GatePolicy:
    """Every threshold the gate applies; `None` means reported but not gated."""

    rule: str = "mcnemar"
    recovery_min: float = 0.99
    margin: float = 0.02
    confidence: float = 0.95
    flip_rate_max: float | None = None
    perplexity_ratio_max: float | None = 1.05
    kl_mean_max: float | None = 0.035
    kl_p99_max: float | None = None
    top1_agreement_min: float | None = None
    shadow_exact_match_min: float | None = 0.90
    shadow_format_error_increase_max: float | None = 0.05
    shadow_error_rate_max: float | None = 0.0
    shadow_length_ratio_deviation_max: float | None = 0.25
    shadow_ttft_p50_ratio_max: float | None = None
    shadow_tpot_p50_ratio_max: float | None = None
    inconclusive: str = "pass"  # what an inconclusive task counts as: "pass" or "fail"
    power: float = DEFAULT_POWER  # of the minimum detectable loss reported per task
    flip_rate_excess_max: float | None = None  # candidate's flip rate minus the control's


def default_policy(weight_bits: int) -> GatePolicy:
    """Thresholds from published practice and kiln's own measurements, per weight width.

    Tasks: the `mcnemar` rule with a 2-point margin at 8 bits (FP8 is near lossless, INT8
    loses 1-3%: arXiv 2411.02355) and 3 points at 4 bits (Red Hat W4A16 cards: 93-99%
    recovery); an inconclusive task does not block. Flips are reported, not gated: greedy
    generation flips 8-12% of items under any 8-bit scheme with no net loss, which the
    paired rule already accounts for.
    Distribution: perplexity ratio <= 1.05 and next-token KL mean <= 0.035 at 8 bits
    (SmolLM2-135M: good 8-bit schemes 1.012-1.037 and 0.015-0.031, planted damage >= 1.078
    and >= 0.042); <= 1.20 and KL reported at 4 bits (W4 measured 1.15-1.18).
    Shadow: greedy exact match >= 0.90 (0.80 at 4 bits), judged beside its noise floor:
    where the control (the baseline's own weights computed at another precision) matches
    less than that, it is reported, not gated (SmolLM2-135M on the sample traffic: float32
    vs bfloat16 compute of the same weights agree on 25% of 48 greedy answers).
    Recovery (>= 0.99, 0.97 at 4 bits) is reported and used by the `recovery*` rules.
    """
    if weight_bits <= 4:
        return GatePolicy(
            recovery_min=0.97,
            margin=0.03,
            perplexity_ratio_max=1.20,
            kl_mean_max=None,
            shadow_exact_match_min=0.80,
        )
    return GatePolicy()
