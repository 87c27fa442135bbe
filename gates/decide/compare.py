"""Comparing the two sides' scores: one task's per-item scores → a `TaskComparison` (means,
standard errors, recovery, paired difference, flips, and the decision rule's outcome), a
perplexity pair → a `PerplexityComparison`, and a whole evaluation's results → `Comparisons`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.gates.decide.rules import (
    Decision,
    GatePolicy,
    count_flips,
    decide,
    recovery_of,
    score_stats,
)
from kiln.gates.measure.divergence import DivergenceSummary
from kiln.gates.measure.noise_floor import NoiseFloor
from kiln.gates.measure.shadow import ShadowReport
from kiln.gates.measure.tasks import TaskResult


@dataclass(slots=True)
class TaskComparison:
    """One task's metric on both sides, with sampling error, flips and the decision."""

    task: str
    metric: str
    higher_is_better: bool
    baseline: float
    candidate: float
    baseline_stderr: float
    candidate_stderr: float
    num_items: int
    recovery: float
    decision: Decision
    right_to_wrong: int | None = None
    wrong_to_right: int | None = None
    flip_rate: float | None = None
    # item id -> [baseline score, candidate score], for auditing flips (paired tasks only)
    item_scores: dict[str, list[float]] = field(default_factory=dict)

    @property
    def outcome(self) -> str:
        """The decision's pass, fail or inconclusive (pass/fail for the two-way rules)."""
        return self.decision.outcome or ("pass" if self.decision.passed else "fail")

    def flipped(self, correct_at: float = 0.5) -> dict[str, list[str]]:
        """Item ids that went right → wrong and wrong → right."""
        out: dict[str, list[str]] = {"right_to_wrong": [], "wrong_to_right": []}
        for item, (b, c) in sorted(self.item_scores.items(), key=lambda kv: _item_order(kv[0])):
            if b >= correct_at > c:
                out["right_to_wrong"].append(item)
            elif c >= correct_at > b:
                out["wrong_to_right"].append(item)
        return out


def _item_order(item: str) -> tuple[int, int, str]:
    """Numeric ids in numeric order (lm-eval's doc ids), others after them by name."""
    return (0, int(item), "") if item.isdigit() else (1, 0, item)


def compare_task(
    task: str,
    metric: str,
    baseline: dict[Any, float],
    candidate: dict[Any, float],
    policy: GatePolicy,
    higher_is_better: bool = True,
    binary: bool = True,
) -> TaskComparison:
    """Compare per-item scores keyed by item id; paired on the items both sides scored."""
    shared = sorted(set(baseline) & set(candidate), key=str)
    paired = bool(shared) and len(shared) == len(baseline) == len(candidate)
    base = [baseline[k] for k in shared] if paired else list(baseline.values())
    cand = [candidate[k] for k in shared] if paired else list(candidate.values())
    decision = decide(
        base, cand, policy, paired=paired, higher_is_better=higher_is_better, task=task
    )
    b, c = score_stats(base), score_stats(cand)
    out = TaskComparison(
        task=task,
        metric=metric,
        higher_is_better=higher_is_better,
        baseline=b.mean,
        candidate=c.mean,
        baseline_stderr=b.stderr,
        candidate_stderr=c.stderr,
        num_items=len(shared) if paired else min(b.n, c.n),
        recovery=decision.recovery,
        decision=decision,
    )
    if paired:
        out.item_scores = {str(k): [baseline[k], candidate[k]] for k in shared}
    if binary and paired:
        flips = count_flips(base, cand)
        out.right_to_wrong, out.wrong_to_right = flips.right_to_wrong, flips.wrong_to_right
        out.flip_rate = flips.rate
    return out


@dataclass(slots=True)
class PerplexityComparison:
    """Held-out perplexity of both sides (lower is better); ratio = candidate / baseline."""

    task: str
    metric: str
    baseline: float
    candidate: float

    @property
    def ratio(self) -> float:
        return 1.0 / recovery_of(self.baseline, self.candidate, higher_is_better=False)


KL_CHECK = "KL divergence"  # an Unmeasured check's name when the divergence is not measured


@dataclass(slots=True)
class Unmeasured:
    """A check the engine that served a side could not answer: it fails the gate, named."""

    check: str  # a task name, or "KL divergence"
    engine: str  # the engine and its version
    reason: str  # what it answered, in its words


@dataclass(slots=True)
class Comparisons:
    """Everything the gate compared between the two sides, before any threshold applies:
    what `build_verdict` turns into checks."""

    tasks: list[TaskComparison] = field(default_factory=list)
    perplexity: list[PerplexityComparison] = field(default_factory=list)
    divergence: DivergenceSummary | None = None
    shadow: ShadowReport | None = None
    noise_floor: NoiseFloor | None = None
    unmeasured: list[Unmeasured] = field(default_factory=list)
    # Where each side was evaluated (gates/measure/served.py's records), and, for a candidate
    # on a serving engine, how that engine's scores differ from kiln's runtime's on it.
    engines: dict[str, Any] = field(default_factory=dict)
    engine_vs_runtime: dict[str, Any] | None = None


def compare_results(
    base: dict[str, TaskResult], cand: dict[str, TaskResult], policy: GatePolicy
) -> Comparisons:
    """Per task: a paired comparison of per-item scores, or a perplexity ratio."""
    tasks: list[TaskComparison] = []
    ppl: list[PerplexityComparison] = []
    for name, c in cand.items():
        b = base[name]
        if c.is_perplexity:
            ppl.append(PerplexityComparison(name, c.metric, b.value, c.value))
            continue
        binary = all(v in (0.0, 1.0) for v in (*b.per_item.values(), *c.per_item.values()))
        tasks.append(
            compare_task(name, c.metric, b.per_item, c.per_item, policy, c.higher_is_better, binary)
        )
    return Comparisons(tasks, ppl)
