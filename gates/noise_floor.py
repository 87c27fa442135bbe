"""The noise floor: how far a control that should be lossless lands from the baseline.

The control is the baseline's own weights rounded to a compute dtype (bfloat16 by default)
and evaluated like the candidate. Its KL, top-1 agreement, perplexity ratio and flips are
what "no loss" measures as on this model, these texts and these tasks; the report puts
every candidate number beside it, and the flip check compares the candidate's flip rate
with the control's instead of with an absolute 5% (greedy generation flips items on
rounding noise alone).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kiln.gates.divergence import DivergenceSummary

CONTROL_DTYPES = ("bfloat16", "float16")


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


def round_weights(model: Any, dtype: str) -> None:
    """Round every parameter of a torch model to `dtype` and back, in place."""
    import torch

    target = getattr(torch, dtype)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(target).to(param.dtype))


def times_floor(value: float | None, floor: float | None) -> str:
    """`value` as a multiple of the floor, for a report ("" when either is missing or 0)."""
    if value is None or floor is None or floor <= 0:
        return ""
    return f"{value / floor:.0f}× the control's {floor:.2g}"
