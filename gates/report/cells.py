"""Numbers and cells both reports format the same way (Markdown and HTML)."""

from __future__ import annotations

import math

from kiln.gates.decide.compare import TaskComparison
from kiln.gates.decide.verdict import GateVerdict
from kiln.gates.measure.noise_floor import NoiseFloor


def num(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, float) and math.isinf(value):
        return "∞"
    return f"{value:.{digits}f}"


def pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def ms(value: float | None) -> str:
    return "—" if value is None else f"{1000 * value:.1f} ms"


def who(side: dict[str, object]) -> str:
    digest = str(side.get("digest") or "")
    short = digest if side.get("kind") == "http" else digest[:12]
    return f"{side.get('name')} ({side.get('kind')}, {short})"


OUTCOME_MARK = {"pass": "✅", "fail": "❌", "inconclusive": "❔"}


FLIPS_SHOWN = 20


def flips_cell(t: TaskComparison) -> str:
    return (
        "—"
        if t.flip_rate is None
        else f"{t.right_to_wrong} / {t.wrong_to_right} ({pct(t.flip_rate)})"
    )


def points(t: TaskComparison, value: float | None) -> str:
    """A loss in points for 0/1 tasks (flips counted), else in the metric's units."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{100 * value:+.2f} pt" if t.flip_rate is not None else f"{value:+.4f}"


def loss_cell(t: TaskComparison) -> str:
    d = t.decision
    if d.loss is None:
        return "—"
    return f"{points(t, d.loss)} [{points(t, d.loss_lower)}, {points(t, d.loss_upper)}]"


def detects(t: TaskComparison) -> str:
    mdl = t.decision.min_detectable_loss
    if mdl is None or not math.isfinite(mdl):
        return "—"
    return f"≥ {100 * mdl:.1f} pt" if t.flip_rate is not None else f"≥ {mdl:.4f}"


def flipped_items(t: TaskComparison) -> list[tuple[str, list[str]]]:
    """(direction, item ids) for each non-empty flip direction, capped for reading."""
    out = []
    for key, label in (("right_to_wrong", "right → wrong"), ("wrong_to_right", "wrong → right")):
        ids = t.flipped()[key]
        if ids:
            more = f" (+{len(ids) - FLIPS_SHOWN} more)" if len(ids) > FLIPS_SHOWN else ""
            out.append((label, [*ids[:FLIPS_SHOWN], *([more.strip()] if more else [])]))
    return out


def rule_line(verdict: GateVerdict) -> str:
    p = verdict.policy
    if p.rule == "mcnemar":
        return (
            f"decision rule: `mcnemar` (fail on evidence of a loss > {100 * p.margin:g} points, "
            f"pass when one is ruled out, at {p.confidence:.0%} one-sided; inconclusive "
            f"counts as {p.inconclusive})"
        )
    return (
        f"decision rule: `{p.rule}` (recovery ≥ {p.recovery_min}, margin {p.margin}, "
        f"confidence {p.confidence})"
    )


def floor_text(floor: NoiseFloor) -> str:
    """What the control (the noise floor) measured, in one line."""
    parts = [f"{floor.control}"]
    if floor.divergence:
        dv = floor.divergence
        parts.append(
            f"KL mean {dv.kl_mean:.5f}, p99 {dv.kl_p99:.5f}, top-1 agreement "
            f"{pct(dv.top1_agreement)}"
        )
    parts += [f"{task} ratio {ratio:.4f}" for task, ratio in floor.perplexity_ratio.items()]
    parts += [f"{task} flips {pct(rate)}" for task, rate in floor.flip_rate.items()]
    return "; ".join(parts)
