"""Numbers and cells both reports format the same way (Markdown and HTML)."""

from __future__ import annotations

import math

from kiln.gates.decide.compare import TaskComparison
from kiln.gates.decide.verdict import GateVerdict
from kiln.gates.measure.noise_floor import NoiseFloor
from kiln.runtime.base.machine import describe_machine


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


def engine_lines(verdict: GateVerdict) -> list[tuple[str, str]]:
    """(label, text) per side's engine (name, version, the command kiln ran, what kiln set)
    and the machine (in process: kiln's runtime or transformers, and the machine)."""
    engines = verdict.engines or {}
    out: list[tuple[str, str]] = []
    for role in ("candidate", "baseline"):
        record = engines.get(role)
        if not record:
            continue
        text = f"{record.get('engine')} {record.get('version') or ''}".strip()
        if record.get("url"):
            text += f" at {record['url']} (model {record.get('model')})"
        if record.get("command"):
            text += f"; command: {' '.join(record['command'])}"
        if record.get("config"):
            text += f"; kiln set: {record['config']}"
        if record.get("log"):
            text += f"; log: {record['log']}"
        out.append((f"engine ({role})", text))
    if engines.get("machine"):
        out.append(("machine", describe_machine(engines["machine"])))
    return out


def engine_vs_runtime_rows(verdict: GateVerdict) -> list[list[str]]:
    """Per task: metric, the runtime's and the engine's value, items changed, agreement; then
    a perplexity row per perplexity task and the KL row."""
    found = verdict.engine_vs_runtime or {}
    rows = []
    for task, t in sorted((found.get("tasks") or {}).items()):
        rows.append([task, t["metric"], num(t["runtime"]), num(t["engine"]),
                     f"{t['items_changed']}/{t['items']}", pct(t["agreement"])])  # fmt: skip
    for task, p in sorted((found.get("perplexity") or {}).items()):
        rows.append([task, "perplexity", num(p["runtime"], 3), num(p["engine"], 3), "—",
                     f"ratio {num(p['ratio'])}"])  # fmt: skip
    kl = found.get("divergence")
    if kl:
        spread = f"mean {kl['kl_mean']:.5f}, p99 {kl['kl_p99']:.5f}"
        top1 = f"top-1 {pct(kl['top1_agreement'])}"
        rows.append(["next-token KL (runtime ‖ engine)", kl["method"], "—", spread,
                     f"{kl['num_tokens']:,} tokens", top1])  # fmt: skip
    return rows


ENGINE_VS_RUNTIME_HEADER = ["", "metric", "kiln runtime", "engine", "items changed", "agreement"]
