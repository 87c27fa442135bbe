"""Decision rules of the gate: sampling error, flips, and the pass/fail rule of one task.

A score difference between two models on a few hundred items is noisy, so every task
comparison carries standard errors and the decision rule can account for them.

Rules (``DecisionRule``), for a higher-is-better metric with per-item scores b_i (baseline)
and c_i (candidate) on the same n items:

- ``recovery``: pass iff  recovery = mean(c) / mean(b) >= recovery_threshold
  (llm-compressor's CI shape; the point estimate only).
- ``noninferior``: let d_i = c_i - b_i, d = mean(d_i), se = sd(d_i) / sqrt(n) (sample sd,
  n - 1). Pass iff the one-sided lower confidence bound  d - z * se >= -margin, where
  z = Phi^-1(confidence) (1.645 at 0.95) and margin is in the metric's own units
  (0.02 = two points of accuracy). This proves, at that confidence, that the candidate is
  at most `margin` worse; it needs enough items for se to be small.
- ``recovery_or_noninferior`` (default): pass iff either rule passes. The paired bound
  rescues a point estimate that dips under the threshold by noise when the paired test is
  tight (few flips), and a recovery above threshold is never failed for being noisy.

When the two sides did not score the same items, the paired difference is unavailable and
the unpaired stderr sqrt(se_b^2 + se_c^2) is used instead. Standard normal quantiles come
from the standard library (`statistics.NormalDist`); everything here is a few lines of
arithmetic, so no statistics package is pulled in.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

DecisionRule = Literal["recovery", "noninferior", "recovery_or_noninferior"]
DECISION_RULES: tuple[str, ...] = ("recovery", "noninferior", "recovery_or_noninferior")


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


def recovery_of(baseline: float, candidate: float, higher_is_better: bool = True) -> float:
    """candidate / baseline for higher-is-better metrics, baseline / candidate otherwise."""
    num, den = (candidate, baseline) if higher_is_better else (baseline, candidate)
    if den == 0:
        return 1.0 if num == 0 else math.inf
    return num / den


def decide(
    baseline: Sequence[float],
    candidate: Sequence[float],
    *,
    rule: str = "recovery_or_noninferior",
    recovery_threshold: float = 0.99,
    margin: float = 0.02,
    confidence: float = 0.95,
    paired: bool = True,
    higher_is_better: bool = True,
) -> Decision:
    """Apply a decision rule to per-item scores of both sides (see the module docstring)."""
    if rule not in DECISION_RULES:
        raise ValueError(f"decision rule {rule!r} is not one of {', '.join(DECISION_RULES)}")
    if not 0.5 <= confidence < 1:
        raise ValueError(f"confidence {confidence} must be in [0.5, 1)")
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


@dataclass(slots=True)
class Check:
    """One thresholded check of the verdict: `value op threshold` and whether it held."""

    name: str
    value: float | None
    threshold: float | None
    op: str  # ">=", "<=", "rule" (a decision rule: see `detail`)
    passed: bool
    detail: str = ""


def threshold_check(name: str, value: float | None, op: str, threshold: float | None) -> Check:
    """`value op threshold`; a missing value fails, a missing threshold is report-only."""
    if threshold is None:
        return Check(name, value, None, op, True, "reported only (no threshold set)")
    if value is None or math.isnan(value):
        return Check(name, value, threshold, op, False, "no value was measured")
    passed = value >= threshold if op == ">=" else value <= threshold
    return Check(name, value, threshold, op, passed)


@dataclass(slots=True)
class GatePolicy:
    """Every threshold the gate applies; `None` means reported but not gated."""

    rule: str = "recovery_or_noninferior"
    recovery_min: float = 0.99
    margin: float = 0.02
    confidence: float = 0.95
    flip_rate_max: float | None = 0.05
    perplexity_ratio_max: float | None = 1.05
    kl_mean_max: float | None = None
    kl_p99_max: float | None = None
    top1_agreement_min: float | None = None
    shadow_exact_match_min: float | None = 0.90
    shadow_format_error_increase_max: float | None = 0.05
    shadow_error_rate_max: float | None = 0.0
    shadow_length_ratio_deviation_max: float | None = 0.25
    shadow_ttft_p50_ratio_max: float | None = None
    shadow_tpot_p50_ratio_max: float | None = None


def default_policy(weight_bits: int) -> GatePolicy:
    """Thresholds from published practice for a scheme of this weight width.

    8-bit (FP8/INT8) and unquantised: recovery >= 0.99, perplexity ratio <= 1.05, greedy
    shadow exact match >= 0.90 (FP8 is near lossless, INT8 loses 1-3%: arXiv 2411.02355).
    4-bit and below: recovery >= 0.97 (Red Hat W4A16 cards: 93-99%), perplexity ratio
    <= 1.20 (SmolLM2-135M measured 1.15-1.18 for W4), exact match >= 0.80 (our choice:
    greedy decodes diverge sooner at 4 bits). Flip rate <= 5% for both (arXiv 2407.09141).
    """
    if weight_bits <= 4:
        return GatePolicy(recovery_min=0.97, perplexity_ratio_max=1.20, shadow_exact_match_min=0.80)
    return GatePolicy()
