"""The gate verdict: the comparisons (compare.py) judged by the policy's checks (checks.py)
→ gate.json. `build_verdict` is the gate's one decide step: the candidate passes only when
every check passes.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln.gates.decide.checks import Check, verdict_checks
from kiln.gates.decide.compare import Comparisons, PerplexityComparison, TaskComparison
from kiln.gates.decide.rules import Decision, GatePolicy
from kiln.gates.measure.divergence import DivergenceSummary
from kiln.gates.measure.noise_floor import NoiseFloor
from kiln.gates.measure.shadow import ShadowReport

GATE_JSON = "gate.json"
VERDICT_VERSION = 1


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
    engines: dict[str, Any] = field(default_factory=dict)  # where each side was evaluated
    engine_vs_runtime: dict[str, Any] | None = None

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
            "engines": self.engines,
            "engine_vs_runtime": self.engine_vs_runtime,
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
            engines=data.get("engines") or {},
            engine_vs_runtime=data.get("engine_vs_runtime"),
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


def build_verdict(
    candidate: dict[str, Any],
    baseline: dict[str, Any],
    policy: GatePolicy,
    comparisons: Comparisons,
    *,
    tools: dict[str, str] | None = None,
    notes: list[str] | None = None,
    seconds: float | None = None,
) -> GateVerdict:
    """The gate's one decide step: apply the policy to every comparison; the verdict passes
    iff every check passes."""
    checks = verdict_checks(comparisons, policy)
    if not checks:
        raise ValueError("a gate with nothing measured cannot pass: give tasks or traffic")
    return GateVerdict(
        passed=all(c.passed for c in checks),
        candidate=candidate,
        baseline=baseline,
        policy=policy,
        tasks=list(comparisons.tasks),
        perplexity=list(comparisons.perplexity),
        divergence=comparisons.divergence,
        shadow=comparisons.shadow,
        checks=checks,
        tools=dict(tools or {}),
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        seconds=seconds,
        notes=list(notes or []),
        noise_floor=comparisons.noise_floor,
        engines=dict(comparisons.engines),
        engine_vs_runtime=comparisons.engine_vs_runtime,
    )
