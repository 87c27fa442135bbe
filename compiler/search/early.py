"""The search's early look: a candidate gated on a quarter of the task items first, at a
stricter confidence (0.99), with the same divergence texts, replaying no traffic and
measuring no noise floor. A task whose loss bound already fails there, or a divergence
check that fails (the same texts as the full gate), fails the candidate without the full
run; the early look fails a good candidate at most 1% of the time per task, so the search's
false rejections stay within the gate's own 5% plus 1%.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from kiln.compiler.recipe.recipe import Recipe
from kiln.gates.decide.checks import DIVERGENCE_CHECKS
from kiln.gates.settings import ShadowSection

SCREEN_FRACTION, SCREEN_CONFIDENCE, SCREEN_MIN_ITEMS = 0.25, 0.99, 32
DEFAULT_ITEMS = 400  # what the early look assumes a task holds when gates.limit is unset


def screen_recipe(recipe: Recipe) -> Recipe | None:
    """The recipe whose gate looks at a quarter of the task items at confidence 0.99 and
    the same divergence texts, replaying no traffic and measuring no noise floor (None
    when the gate has too few items, or no tasks, for an early look to save anything)."""
    gates = recipe.config.gates
    assert gates is not None  # check_settings refused a recipe without one
    items = gates.limit or DEFAULT_ITEMS
    if not gates.tasks or items < SCREEN_MIN_ITEMS:
        return None
    thresholds = gates.thresholds.model_copy(update={"confidence": SCREEN_CONFIDENCE})
    screened = gates.model_copy(
        update={
            "limit": max(1, math.ceil(items * SCREEN_FRACTION)),
            "thresholds": thresholds,
            "shadow": ShadowSection(),
            "noise_floor": "off",
        }
    )
    return replace(recipe, config=recipe.config.model_copy(update={"gates": screened}))


def decided_fail(verdict: dict[str, Any]) -> bool:
    """The early look's verdict settles a fail: a task's loss bound beyond its margin, or a
    failed divergence check (measured on the same texts as the full gate). A perplexity ratio
    or accuracy on a quarter of the items settles nothing."""
    tasks = [t.get("decision") or {} for t in verdict.get("tasks", [])]
    if any(d.get("outcome") == "fail" for d in tasks):
        return True
    return any(not c.get("passed") and c["name"] in DIVERGENCE_CHECKS
               for c in verdict.get("checks", []))  # fmt: skip
