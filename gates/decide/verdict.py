"""The gate verdict: per-task comparisons, divergence, shadow results, checks → gate.json.

`compare_task` turns per-item scores of both sides into a `TaskComparison` (means,
standard errors, recovery, paired difference, flips, and the decision rule's outcome);
`build_verdict` collects every comparison, applies the policy's thresholds as `Check`s and
says whether the candidate passes: it passes only when every check passes.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln.gates.decide.rules import (
    Check,
    Decision,
    GatePolicy,
    count_flips,
    decide,
    recovery_of,
    score_stats,
    threshold_check,
)
from kiln.gates.measure.divergence import DivergenceSummary
from kiln.gates.measure.noise_floor import NoiseFloor, times_floor
from kiln.gates.measure.shadow import ShadowReport, shadow_checks

GATE_JSON = "gate.json"
VERDICT_VERSION = 1


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
        base,
        cand,
        rule=policy.rule,
        recovery_threshold=policy.recovery_min,
        margin=policy.margin,
        confidence=policy.confidence,
        paired=paired,
        higher_is_better=higher_is_better,
        inconclusive=policy.inconclusive,
        power=policy.power,
        task=task,
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


@dataclass(slots=True)
class GateVerdict:
    """Everything the gate measured and decided; `to_dict` is gate.json."""

    passed: bool
    candidate: dict[str, Any]
    baseline: dict[str, Any]
    policy: GatePolicy
    tasks: list[TaskComparison] = field(default_factory=list)
    perplexity: list[PerplexityComparison] = field(default_factory=list)
    divergence: DivergenceSummary | None = None
    shadow: ShadowReport | None = None
    checks: list[Check] = field(default_factory=list)
    tools: dict[str, str] = field(default_factory=dict)
    created_at: str = ""
    seconds: float | None = None
    notes: list[str] = field(default_factory=list)
    noise_floor: NoiseFloor | None = None

    @property
    def failed_checks(self) -> list[Check]:
        return [c for c in self.checks if not c.passed]

    @property
    def inconclusive_checks(self) -> list[Check]:
        return [c for c in self.checks if c.outcome == "inconclusive"]

    def to_dict(self) -> dict[str, Any]:
        data = {
            "version": VERDICT_VERSION,
            "passed": self.passed,
            "candidate": self.candidate,
            "baseline": self.baseline,
            "policy": asdict(self.policy),
            "tasks": [asdict(t) for t in self.tasks],
            "perplexity": [{**asdict(p), "ratio": p.ratio} for p in self.perplexity],
            "divergence": self.divergence.to_dict() if self.divergence else None,
            "shadow": self.shadow.to_dict() if self.shadow else None,
            "checks": [asdict(c) for c in self.checks],
            "inconclusive": [c.name for c in self.inconclusive_checks],
            "tools": self.tools,
            "created_at": self.created_at,
            "seconds": self.seconds,
            "notes": self.notes,
            "noise_floor": self.noise_floor.to_dict() if self.noise_floor else None,
        }
        return _finite(data)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GateVerdict:
        """Rebuild a verdict from gate.json (for reports of stored runs)."""
        tasks = []
        for t in data.get("tasks", []):
            t = {k: (math.nan if v is None and k in _FLOAT_FIELDS else v) for k, v in t.items()}
            t["decision"] = Decision(**_nan(t["decision"]))
            tasks.append(TaskComparison(**t))
        return cls(
            passed=bool(data["passed"]),
            candidate=data["candidate"],
            baseline=data["baseline"],
            policy=GatePolicy(**data["policy"]),
            tasks=tasks,
            perplexity=[
                PerplexityComparison(p["task"], p["metric"], p["baseline"], p["candidate"])
                for p in data.get("perplexity", [])
            ],
            divergence=(
                DivergenceSummary.from_dict(data["divergence"]) if data.get("divergence") else None
            ),
            shadow=ShadowReport.from_dict(data["shadow"]) if data.get("shadow") else None,
            checks=[Check(**c) for c in data.get("checks", [])],
            tools=data.get("tools", {}),
            created_at=data.get("created_at", ""),
            seconds=data.get("seconds"),
            notes=data.get("notes", []),
            noise_floor=(
                NoiseFloor.from_dict(data["noise_floor"]) if data.get("noise_floor") else None
            ),
        )

    def write(self, out_dir: str | Path) -> Path:
        """Write gate.json into out_dir; returns its path."""
        path = Path(out_dir) / GATE_JSON
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path


_FLOAT_FIELDS = {"baseline", "candidate", "baseline_stderr", "candidate_stderr", "recovery"}


def _nan(data: dict[str, Any]) -> dict[str, Any]:
    return {
        k: math.nan if v is None and k not in ("explanation", "rule") else v
        for k, v in data.items()
    }


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: write them as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


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


def _note(check: Check, text: str) -> Check:
    """Put `text` (the control's value, say) in front of a check's detail."""
    if text:
        check.detail = f"{text}; {check.detail}" if check.detail else text
    return check


def build_verdict(
    candidate: dict[str, Any],
    baseline: dict[str, Any],
    policy: GatePolicy,
    tasks: list[TaskComparison] | None = None,
    perplexity: list[PerplexityComparison] | None = None,
    divergence: DivergenceSummary | None = None,
    shadow: ShadowReport | None = None,
    tools: dict[str, str] | None = None,
    notes: list[str] | None = None,
    seconds: float | None = None,
    noise_floor: NoiseFloor | None = None,
) -> GateVerdict:
    """Apply the policy to every comparison; the verdict passes iff every check passes."""
    tasks, perplexity = list(tasks or []), list(perplexity or [])
    floor = noise_floor
    checks: list[Check] = []
    for task in tasks:
        checks.extend(task_checks(task, policy, floor))
    for ppl in perplexity:
        check = threshold_check(
            f"{ppl.task}: {ppl.metric} ratio", ppl.ratio, "<=", policy.perplexity_ratio_max
        )
        control = floor.perplexity_ratio.get(ppl.task) if floor else None
        checks.append(_note(check, f"control {control:.4f}" if control is not None else ""))
    if divergence is not None:
        base = floor.divergence if floor else None
        checks += [
            _note(
                threshold_check("KL divergence mean", divergence.kl_mean, "<=", policy.kl_mean_max),
                times_floor(divergence.kl_mean, base.kl_mean if base else None),
            ),
            _note(
                threshold_check("KL divergence p99", divergence.kl_p99, "<=", policy.kl_p99_max),
                times_floor(divergence.kl_p99, base.kl_p99 if base else None),
            ),
            _note(
                threshold_check(
                    "top-1 agreement", divergence.top1_agreement, ">=", policy.top1_agreement_min
                ),
                f"control {base.top1_agreement:.1%}" if base else "",
            ),
        ]
    if shadow is not None:
        checks += shadow_checks(shadow, policy)
    if not checks:
        raise ValueError("a gate with nothing measured cannot pass: give tasks or traffic")
    return GateVerdict(
        passed=all(c.passed for c in checks),
        candidate=candidate,
        baseline=baseline,
        policy=policy,
        tasks=tasks,
        perplexity=perplexity,
        divergence=divergence,
        shadow=shadow,
        checks=checks,
        tools=dict(tools or {}),
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        seconds=seconds,
        notes=list(notes or []),
        noise_floor=floor,
    )
