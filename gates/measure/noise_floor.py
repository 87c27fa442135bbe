"""The noise floor: how far a control that should be lossless lands from the baseline.

The control is the float baseline's own weights served by kiln's runtime in a compute dtype
(by default the one the candidate ran in) and evaluated exactly as the candidate is: the
same engine, the same lm-eval adapter, the same top-k logprobs on the same texts. So it
carries everything "lossless as shipped" carries (the compute dtype's rounding, the
runtime's kernels) and nothing a quantisation scheme adds. Its KL, top-1 agreement,
perplexity ratio and flips are what "no loss" measures as on this model, these texts and
these tasks; the report puts every candidate number beside it, and the flip check compares
the candidate's flip rate with the control's instead of with an absolute 5% (greedy
generation flips items on rounding noise alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.gates.measure.divergence import DivergenceSummary


@dataclass(slots=True)
class NoiseFloor:
    """The control's comparison with the baseline, in the verdict's terms."""

    control: str  # what the control is, in words
    dtype: str
    divergence: DivergenceSummary | None = None
    perplexity_ratio: dict[str, float] = field(default_factory=dict)
    flip_rate: dict[str, float] = field(default_factory=dict)
    loss: dict[str, float] = field(default_factory=dict)  # per task, in the metric's units

    def to_dict(self) -> dict[str, Any]:
        return {
            "control": self.control,
            "dtype": self.dtype,
            "divergence": self.divergence.to_dict() if self.divergence else None,
            "perplexity_ratio": self.perplexity_ratio,
            "flip_rate": self.flip_rate,
            "loss": self.loss,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> NoiseFloor:
        div = data.get("divergence")
        return cls(
            control=data["control"],
            dtype=data["dtype"],
            divergence=DivergenceSummary.from_dict(div) if div else None,
            perplexity_ratio=dict(data.get("perplexity_ratio") or {}),
            flip_rate=dict(data.get("flip_rate") or {}),
            loss=dict(data.get("loss") or {}),
        )


def control_dtype(setting: str, candidate_engine: Any) -> str:
    """The control's compute dtype: `setting` (gates.noise_floor), where "auto" is the dtype
    the candidate's runtime engine computes in."""
    return setting if setting != "auto" else engine_dtype(candidate_engine)


def engine_dtype(engine: Any) -> str:
    """The dtype a runtime engine computes in, by name ("bfloat16")."""
    return str(engine.model.dtype).removeprefix("torch.")


def describe_control(dtype: str) -> str:
    """What the control is, in the report's words."""
    return f"the baseline served by kiln's runtime in {dtype}"


def times_floor(value: float | None, floor: float | None) -> str:
    """`value` as a multiple of the floor, for a report ("" when either is missing or 0)."""
    if value is None or floor is None or floor <= 0:
        return ""
    return f"{value / floor:.0f}× the control's {floor:.2g}"
