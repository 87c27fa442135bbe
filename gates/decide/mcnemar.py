"""Paired comparison with a margin: exact McNemar bounds on the loss, verdict, power.

For one task scored right/wrong on the same n items by both sides, only the discordant
items carry information: b went right → wrong, c wrong → right, m = b + c. The loss (in
accuracy, positive = the candidate is worse) is (b − c) / n = ψ (2π − 1), where ψ = m / n is
the discordant rate and π the chance that a discordant item is a loss. Given m, b is
Binomial(m, π) (the exact McNemar test is the test of π = 1/2), so one-sided Clopper–Pearson
bounds on π (`scipy.stats.binomtest`) give one-sided bounds on the loss:

- FAIL when the lower bound ψ (2π_lo − 1) exceeds the margin: evidence of a loss beyond
  it. At margin 0 this is the exact one-sided McNemar test at 1 − confidence, so a candidate
  with no loss larger than the margin fails with probability at most 1 − confidence.
- PASS when the upper bound ψ' (2π_hi − 1) is at most the margin: the evidence rules out a
  larger loss, wrongly with probability at most 1 − confidence. ψ' is ψ, but at least the
  discordant rate that zero discordant items could not rule out (1 − α^(1/n), the "rule of
  three"), so a handful of items with no flips does not pass on no evidence.
- otherwise INCONCLUSIVE: the task is too small (or too noisy) for its margin.

Scores that are not 0/1 use the paired normal bounds instead (mean difference ± z · sd/√n),
and two sides that scored different items the unpaired ones.

The minimum detectable loss at one-sided level α and power 1 − β is (z_α + z_β) √(ψ / n) for
McNemar's test (normal approximation; ~140 items at 5% flips: 4.6 points), the number a
user needs to size a task against its margin.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal

Outcome = Literal["pass", "fail", "inconclusive"]
DEFAULT_POWER = 0.8


@dataclass(slots=True)
class LossBounds:
    """One task's loss (baseline − candidate, in the metric's units) with one-sided bounds."""

    method: str  # "exact-mcnemar" or "paired-normal"
    n: int
    loss: float
    loss_lower: float
    loss_upper: float
    p_value: float  # one-sided, H0: no loss (exact McNemar for 0/1 scores)
    min_detectable_loss: float  # at the confidence and power asked for
    power: float = DEFAULT_POWER


def _clopper_pearson(k: int, n: int, confidence: float) -> tuple[float, float]:
    """One-sided lower and upper Clopper–Pearson bounds of a binomial proportion k / n
    (the beta quantiles `binomtest(...).proportion_ci(method="exact")` computes)."""
    from scipy.stats import beta

    if n == 0:
        return 0.0, 1.0
    alpha = 1.0 - confidence
    low = float(beta.ppf(alpha, k, n - k + 1)) if k > 0 else 0.0
    high = float(beta.ppf(confidence, k + 1, n - k)) if k < n else 1.0
    return low, high


def min_detectable_loss(
    n: int, discordant_rate: float, confidence: float = 0.95, power: float = DEFAULT_POWER
) -> float:
    """Smallest loss a one-sided paired test on n items detects with this power."""
    if n == 0:
        return math.inf
    z = NormalDist().inv_cdf(confidence) + NormalDist().inv_cdf(power)
    return z * math.sqrt(discordant_rate / n)


def binary_loss_bounds(
    right_to_wrong: int,
    wrong_to_right: int,
    n: int,
    confidence: float = 0.95,
    power: float = DEFAULT_POWER,
) -> LossBounds:
    """Exact conditional McNemar bounds on the loss of 0/1 scores (see the module docstring)."""
    from scipy.stats import binom

    b, m = right_to_wrong, right_to_wrong + wrong_to_right
    if n <= 0 or m > n:
        raise ValueError(f"need 0 <= discordant ({m}) <= n ({n}) and n > 0")
    psi = m / n
    floor = 1.0 - (1.0 - confidence) ** (1.0 / n)
    psi_upper = max(psi, floor)
    pi_low, pi_high = _clopper_pearson(b, m, confidence)
    p_value = float(binom.sf(b - 1, m, 0.5)) if m else 1.0  # P(X >= b), X ~ Bin(m, 1/2)
    return LossBounds(
        method="exact-mcnemar",
        n=n,
        loss=(b - wrong_to_right) / n,
        loss_lower=psi * (2 * pi_low - 1),
        loss_upper=(psi_upper if pi_high >= 0.5 else psi) * (2 * pi_high - 1),
        p_value=p_value,
        min_detectable_loss=min_detectable_loss(n, psi_upper, confidence, power),
        power=power,
    )


def paired_loss_bounds(
    baseline: Sequence[float],
    candidate: Sequence[float],
    confidence: float = 0.95,
    power: float = DEFAULT_POWER,
) -> LossBounds:
    """Normal bounds on mean(baseline − candidate) over the same items (any scores)."""
    n = len(baseline)
    if n != len(candidate) or n == 0:
        raise ValueError(f"paired bounds need the same, non-empty items: {n} vs {len(candidate)}")
    losses = [b - c for b, c in zip(baseline, candidate, strict=True)]
    loss = math.fsum(losses) / n
    sd = math.sqrt(math.fsum((x - loss) ** 2 for x in losses) / (n - 1)) if n > 1 else 0.0
    se = sd / math.sqrt(n)
    z = NormalDist().inv_cdf(confidence)
    p_value = 1.0 - NormalDist().cdf(loss / se) if se > 0 else (0.0 if loss > 0 else 1.0)
    mdl_z = z + NormalDist().inv_cdf(power)
    return LossBounds(
        "paired-normal", n, loss, loss - z * se, loss + z * se, p_value, mdl_z * se, power
    )


def unpaired_loss_bounds(
    baseline: Sequence[float],
    candidate: Sequence[float],
    confidence: float = 0.95,
    power: float = DEFAULT_POWER,
) -> LossBounds:
    """Normal bounds on mean(baseline) − mean(candidate) when the items differ."""
    n_b, n_c = len(baseline), len(candidate)
    if n_b == 0 or n_c == 0:  # nothing to compare: neither bound can settle anything
        return LossBounds("unpaired-normal", 0, math.nan, -math.inf, math.inf, 1.0, math.inf, power)
    mean_b, mean_c = math.fsum(baseline) / n_b, math.fsum(candidate) / n_c

    def var(xs: Sequence[float], mean: float) -> float:
        return math.fsum((x - mean) ** 2 for x in xs) / (len(xs) - 1) if len(xs) > 1 else 0.0

    se = math.sqrt(var(baseline, mean_b) / n_b + var(candidate, mean_c) / n_c)
    loss = mean_b - mean_c
    z = NormalDist().inv_cdf(confidence)
    p_value = 1.0 - NormalDist().cdf(loss / se) if se > 0 else float(loss <= 0)
    mdl = (z + NormalDist().inv_cdf(power)) * se
    return LossBounds(
        "unpaired-normal", min(n_b, n_c), loss, loss - z * se, loss + z * se, p_value, mdl, power
    )


def outcome_of(bounds: LossBounds, margin: float) -> Outcome:
    """FAIL on evidence of a loss beyond the margin, PASS when one is ruled out, else neither."""
    if bounds.loss_lower > margin:
        return "fail"
    if bounds.loss_upper <= margin:
        return "pass"
    return "inconclusive"


def explain(task: str, bounds: LossBounds, margin: float, confidence: float, scale: float) -> str:
    """One sentence with the numbers behind the outcome; scale 100 writes points."""
    unit = " points" if scale == 100 else ""
    outcome = outcome_of(bounds, margin)

    def num(x: float) -> str:
        return f"{scale * x:.2f}" if math.isfinite(x) else "∞"

    power = (
        f"{bounds.n} items detect ≥ {num(bounds.min_detectable_loss)}{unit} "
        f"at {bounds.power:.0%} power, one-sided {1 - confidence:.0%}"
    )
    loss = (
        f"loss {num(bounds.loss)}{unit}, {confidence:.0%} bounds [{num(bounds.loss_lower)}, "
        f"{num(bounds.loss_upper)}] ({bounds.method}, p = {bounds.p_value:.3g})"
    )
    if outcome == "fail":
        return f"fail on {task}: {loss}; lower bound > margin {num(margin)}{unit} ({power})"
    if outcome == "pass":
        return f"pass on {task}: {loss}; upper bound ≤ margin {num(margin)}{unit} ({power})"
    return (
        f"inconclusive on {task} ({power}): {loss}; neither bound settles margin "
        f"{num(margin)}{unit}"
    )
