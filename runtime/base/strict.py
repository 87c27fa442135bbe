"""The base of every user-facing configuration model (the recipe's sections, a gate file):
unknown keys are refused, and a validated section is frozen."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A pydantic model with `extra="forbid"` and `frozen=True`."""

    model_config = ConfigDict(extra="forbid", frozen=True)
