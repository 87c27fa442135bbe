"""The search's answer per target: each judged candidate's quality (from its gate verdict)
beside its price, the Pareto frontier of KL divergence against price, and the winner — the
cheapest candidate whose gate passed (on a tie, the smaller loss). Ours: the frontier of two
numbers needs no library.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class Quality:
    """What the gate measured of one candidate."""

    passed: bool
    loss: float | None  # the largest task loss (baseline − candidate), points/100
    loss_lower: float | None
    loss_upper: float | None
    kl_mean: float | None
    perplexity_ratio: float | None
    failed_checks: list[str]
    screened_out: bool = False  # the early look already failed it

    @property
    def score(self) -> float:
        """The frontier's quality axis: the KL divergence from the baseline (every gate
        measures it, and it separates schemes that a few task items cannot), else the task
        loss."""
        if self.kl_mean is not None:
            return self.kl_mean
        return self.loss if self.loss is not None else math.inf

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def quality_of(verdict: dict[str, Any], screened_out: bool = False) -> Quality:
    """A gate.json verdict as the frontier reads it."""
    decisions = [t.get("decision") or {} for t in verdict.get("tasks", [])]
    worst = max(decisions, key=lambda d: d.get("loss", -math.inf), default=None)
    divergence = verdict.get("divergence") or {}
    ratios = [p.get("ratio") for p in verdict.get("perplexity", []) if p.get("ratio") is not None]
    return Quality(
        passed=bool(verdict.get("passed")),
        loss=None if worst is None else worst.get("loss"),
        loss_lower=None if worst is None else worst.get("loss_lower"),
        loss_upper=None if worst is None else worst.get("loss_upper"),
        kl_mean=divergence.get("kl_mean"),
        perplexity_ratio=max(ratios) if ratios else None,
        failed_checks=[c["name"] for c in verdict.get("checks", []) if not c.get("passed")],
        screened_out=screened_out,
    )


def frontier(rows: list[dict[str, Any]]) -> list[str]:
    """Ids of the passing rows no other passing row beats on both price and quality (rows:
    `id`, `passed`, `price` (None: does not fit), `score`): the deployments worth choosing
    between, each one the gate accepted."""
    priced = [r for r in rows if r["price"] is not None and r["passed"]]
    out = []
    for r in priced:
        dominated = any(
            o["price"] <= r["price"]
            and o["score"] <= r["score"]
            and (o["price"] < r["price"] or o["score"] < r["score"])
            for o in priced
        )
        if not dominated:
            out.append(r["id"])
    return out


def winner(rows: list[dict[str, Any]]) -> str | None:
    """The cheapest passing row (ties: the smaller loss); None when none passed."""
    passing = [r for r in rows if r["passed"] and r["price"] is not None]
    if not passing:
        return None
    return min(passing, key=lambda r: (r["price"], r["score"]))["id"]


def closest(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The failing row that came nearest: fewest failed checks, then the smallest loss."""
    failing = [r for r in rows if not r["passed"]]
    if not failing:
        return None
    return min(failing, key=lambda r: (len(r["failed_checks"]), r["score"]))
