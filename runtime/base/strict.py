"""The base of every user-facing configuration model (the recipe's sections, a gate file):
unknown keys are refused, values are taken as typed (`true` is no number, `"3"` no integer),
numbers are finite, and a validated section is frozen."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A pydantic model with `extra="forbid"`, strict types, finite floats, `frozen=True`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, allow_inf_nan=False)
