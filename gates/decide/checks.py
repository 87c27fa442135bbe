"""The verdict's checks: one thresholded comparison each (`value op threshold`), a task's
decision rule, its flips, and the shadow comparison's thresholds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.gates.decide.compare import Comparisons, PerplexityComparison, TaskComparison
from kiln.gates.decide.rules import GatePolicy
from kiln.gates.measure.noise_floor import NoiseFloor, times_floor
from kiln.gates.measure.shadow import ShadowReport

NO_THRESHOLD = "reported only (no threshold set)"  # the detail of a check that is not gated
NOT_MEASURED = "not measured"  # the outcome of a check its engine could not answer
# The checks of the next-token divergence on the held-out texts (their names in gate.json).
KL_MEAN, KL_P99, TOP1_AGREEMENT = "KL divergence mean", "KL divergence p99", "top-1 agreement"
DIVERGENCE_CHECKS = (KL_MEAN, KL_P99, TOP1_AGREEMENT)


@dataclass(slots=True)
class Check:
    """One thresholded check of the verdict: `value op threshold` and whether it held."""

    name: str
    value: float | None
    threshold: float | None
    op: str  # ">=", "<=", "rule" (a decision rule: see `detail`)
    passed: bool
    detail: str = ""
    outcome: str = ""  # a rule's "pass", "fail" or "inconclusive"; else pass/fail of `passed`


def threshold_check(name: str, value: float | None, op: str, threshold: float | None) -> Check:
    """`value op threshold`; a missing or non-finite value fails (what could not be computed
    is never a pass), a missing threshold is report-only."""
    if threshold is None:
        return Check(name, value, None, op, True, NO_THRESHOLD)
    if value is None or not math.isfinite(value):
        return Check(name, value, threshold, op, False, "no finite value was measured")
    passed = value >= threshold if op == ">=" else value <= threshold
    return Check(name, value, threshold, op, passed)


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def exact_match_check(report: ShadowReport, minimum: float | None) -> Check:
    """Exact match against its threshold, beside the control's. Greedy decoding turns a
    rounding difference into a different answer from that token on: where the lossless
    control itself falls below the threshold, no candidate can be expected to meet it, so
    the check is reported, not gated (like flips, which the paired task rule accounts for)."""
    name, rate, control = (
        "shadow: exact match",
        report.exact_match_rate,
        report.control_exact_match_rate,
    )
    if control is None:
        return threshold_check(name, rate, ">=", minimum)
    floor = f"control ({report.control}) {control:.1%}"
    if minimum is not None and control < minimum:
        return Check(
            name, rate, None, ">=", True,
            f"{floor} < {minimum:.0%}: greedy answers diverge on rounding alone on this "
            "traffic, so exact match is reported, not gated",
        )  # fmt: skip
    check = threshold_check(name, rate, ">=", minimum)
    check.detail = f"{floor}; {check.detail}" if check.detail else floor
    return check


def shadow_checks(report: ShadowReport, policy: GatePolicy) -> list[Check]:
    """The shadow thresholds of a policy applied to a shadow comparison's report."""
    deviation = abs(report.length_ratio - 1.0)
    format_increase = report.candidate_format_error_rate - report.baseline_format_error_rate
    base_lat, cand_lat = report.baseline_latency, report.candidate_latency
    return [
        exact_match_check(report, policy.shadow_exact_match_min),
        threshold_check(
            "shadow: format errors (candidate - baseline)",
            format_increase,
            "<=",
            policy.shadow_format_error_increase_max,
        ),
        threshold_check(
            "shadow: candidate error rate",
            report.candidate_error_rate,
            "<=",
            policy.shadow_error_rate_max,
        ),
        threshold_check(
            "shadow: |length ratio - 1|", deviation, "<=", policy.shadow_length_ratio_deviation_max
        ),
        threshold_check(
            "shadow: TTFT p50 ratio",
            _ratio(cand_lat.ttft_p50, base_lat.ttft_p50),
            "<=",
            policy.shadow_ttft_p50_ratio_max,
        ),
        threshold_check(
            "shadow: TPOT p50 ratio",
            _ratio(cand_lat.tpot_p50, base_lat.tpot_p50),
            "<=",
            policy.shadow_tpot_p50_ratio_max,
        ),
    ]


def task_checks(
    task: TaskComparison, policy: GatePolicy, floor: NoiseFloor | None = None
) -> list[Check]:
    """A task's decision rule, its flip rate, and its flips beyond the control's, as checks."""
    d = task.decision
    # the mcnemar rule judges the loss against the margin; the others, recovery
    value, threshold = (
        (d.loss, d.margin) if d.loss is not None else (task.recovery, d.recovery_threshold)
    )
    checks = [
        Check(
            f"{task.task}: {task.metric} ({d.rule})",
            value,
            threshold,
            "rule",
            d.passed,
            d.explanation,
            task.outcome,
        )
    ]
    if task.flip_rate is not None:
        checks.append(
            threshold_check(f"{task.task}: flip rate", task.flip_rate, "<=", policy.flip_rate_max)
        )
    control = floor.flip_rate.get(task.task) if floor else None
    if task.flip_rate is not None and control is not None:
        excess = threshold_check(
            f"{task.task}: flip rate over the control",
            task.flip_rate - control,
            "<=",
            policy.flip_rate_excess_max,
        )
        checks.append(_note(excess, f"flips {task.flip_rate:.1%}, control {control:.1%}"))
    return checks


def perplexity_problem(ppl: PerplexityComparison) -> str:
    """Why a perplexity pair is no measurement (a perplexity is finite and at least 1), or ""."""
    floor = 0.0 if ppl.metric == "bits_per_byte" else 1.0
    bad = [
        f"the {side}'s {ppl.metric} is {value!r}"
        for side, value in (("baseline", ppl.baseline), ("candidate", ppl.candidate))
        if not (math.isfinite(value) and value >= floor)
    ]
    if not bad:
        return ""
    return f"{' and '.join(bad)}: not a {ppl.metric} (finite, at least {floor:g})"


def _note(check: Check, text: str) -> Check:
    """Put `text` (the control's value, say) in front of a check's detail."""
    if text:
        check.detail = f"{text}; {check.detail}" if check.detail else text
    return check


def verdict_checks(comparisons: Comparisons, policy: GatePolicy) -> list[Check]:
    """Every check of a verdict, in report order: tasks, perplexity, divergence, shadow."""
    floor = comparisons.noise_floor
    checks: list[Check] = []
    for task in comparisons.tasks:
        checks.extend(task_checks(task, policy, floor))
    for ppl in comparisons.perplexity:
        name = f"{ppl.task}: {ppl.metric} ratio"
        impossible = perplexity_problem(ppl)
        if impossible:
            checks.append(Check(name, None, policy.perplexity_ratio_max, "<=", False, impossible,
                                NOT_MEASURED))  # fmt: skip
            continue
        check = threshold_check(name, ppl.ratio, "<=", policy.perplexity_ratio_max)
        control = floor.perplexity_ratio.get(ppl.task) if floor else None
        checks.append(_note(check, f"control {control:.4f}" if control is not None else ""))
    divergence = comparisons.divergence
    if divergence is not None:
        base = floor.divergence if floor else None
        checks += [
            _note(
                threshold_check(KL_MEAN, divergence.kl_mean, "<=", policy.kl_mean_max),
                times_floor(divergence.kl_mean, base.kl_mean if base else None),
            ),
            _note(
                threshold_check(KL_P99, divergence.kl_p99, "<=", policy.kl_p99_max),
                times_floor(divergence.kl_p99, base.kl_p99 if base else None),
            ),
            _note(
                threshold_check(
                    TOP1_AGREEMENT, divergence.top1_agreement, ">=", policy.top1_agreement_min
                ),
                f"control {base.top1_agreement:.1%}" if base else "",
            ),
        ]
    if comparisons.shadow is not None:
        checks += shadow_checks(comparisons.shadow, policy)
    for missing in comparisons.unmeasured:
        checks.append(Check(f"{missing.check}: not measured", None, None, "measured", False,
                            f"on {missing.engine}: {missing.reason}", NOT_MEASURED))  # fmt: skip
    return checks
