"""Gate reports: gate.json, a Markdown summary for CI logs and PR comments, an HTML page.

The HTML report is one self-contained file (inline CSS and SVG, no scripts, no external
assets) so it can be attached to a CI run or opened offline. Every piece of model or
user text goes through `html.escape`. Hand-written: a templating engine would be a new
dependency for one page.
"""

from __future__ import annotations

import html
import math
from pathlib import Path
from typing import Any

from kiln.gates.decide.rules import NO_THRESHOLD, Check
from kiln.gates.decide.verdict import GateVerdict, TaskComparison
from kiln.gates.measure.noise_floor import NoiseFloor
from kiln.gates.measure.shadow import PairDiff

MARKDOWN = "gate.md"
HTML = "gate.html"


def _num(value: float | None, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "—"
    if isinstance(value, float) and math.isinf(value):
        return "∞"
    return f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}%"


def _ms(value: float | None) -> str:
    return "—" if value is None else f"{1000 * value:.1f} ms"


def _who(side: dict[str, object]) -> str:
    digest = str(side.get("digest") or "")
    short = digest if side.get("kind") == "http" else digest[:12]
    return f"{side.get('name')} ({side.get('kind')}, {short})"


_OUTCOME_MARK = {"pass": "✅", "fail": "❌", "inconclusive": "❔"}
_FLIPS_SHOWN = 20


def _flips(t: TaskComparison) -> str:
    return (
        "—"
        if t.flip_rate is None
        else f"{t.right_to_wrong} / {t.wrong_to_right} ({_pct(t.flip_rate)})"
    )


def _points(t: TaskComparison, value: float | None) -> str:
    """A loss in points for 0/1 tasks (flips counted), else in the metric's units."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "—"
    return f"{100 * value:+.2f} pt" if t.flip_rate is not None else f"{value:+.4f}"


def _loss_cell(t: TaskComparison) -> str:
    d = t.decision
    if d.loss is None:
        return "—"
    return f"{_points(t, d.loss)} [{_points(t, d.loss_lower)}, {_points(t, d.loss_upper)}]"


def _detects(t: TaskComparison) -> str:
    mdl = t.decision.min_detectable_loss
    if mdl is None or not math.isfinite(mdl):
        return "—"
    return f"≥ {100 * mdl:.1f} pt" if t.flip_rate is not None else f"≥ {mdl:.4f}"


def _flipped_items(t: TaskComparison) -> list[tuple[str, list[str]]]:
    """(direction, item ids) for each non-empty flip direction, capped for reading."""
    out = []
    for key, label in (("right_to_wrong", "right → wrong"), ("wrong_to_right", "wrong → right")):
        ids = t.flipped()[key]
        if ids:
            more = f" (+{len(ids) - _FLIPS_SHOWN} more)" if len(ids) > _FLIPS_SHOWN else ""
            out.append((label, [*ids[:_FLIPS_SHOWN], *([more.strip()] if more else [])]))
    return out


def _rule_line(verdict: GateVerdict) -> str:
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


def _floor_text(floor: NoiseFloor) -> str:
    """What the control (the noise floor) measured, in one line."""
    parts = [f"{floor.control}"]
    if floor.divergence:
        dv = floor.divergence
        parts.append(
            f"KL mean {dv.kl_mean:.5f}, p99 {dv.kl_p99:.5f}, top-1 agreement "
            f"{_pct(dv.top1_agreement)}"
        )
    parts += [f"{task} ratio {ratio:.4f}" for task, ratio in floor.perplexity_ratio.items()]
    parts += [f"{task} flips {_pct(rate)}" for task, rate in floor.flip_rate.items()]
    return "; ".join(parts)


_OPS = {"<=": "≤", ">=": "≥"}
_CHECK_MARK = {"pass": "✅", "fail": "❌", "inconclusive": "❔", "reported": "➖"}


def _check_state(check: Check) -> str:
    if check.outcome == "inconclusive":
        return "inconclusive"
    if check.threshold is None and check.op != "rule":
        return "reported"
    return "pass" if check.passed else "fail"


def _check_cells(check: Check, tasks: dict[str, TaskComparison]) -> tuple[str, str]:
    """A check's value and its rule, in the units a reader compares them in."""
    if check.op == "rule":
        task = tasks.get(check.name)
        if task is None or check.value is None or check.threshold is None:
            return _num(check.value), "decision rule"
        return f"loss {_points(task, check.value)}", f"loss ≤ {_points(task, check.threshold)}"
    if check.threshold is None:
        return _num(check.value), "reported only"
    return _num(check.value), f"{_OPS.get(check.op, check.op)} {_num(check.threshold)}"


def _failure(check: Check, tasks: dict[str, TaskComparison]) -> str:
    """`name value, needs threshold` for a failed check (its rule's reason for a task)."""
    value, threshold = _check_cells(check, tasks)
    if check.op == "rule":
        return f"{check.name}: {check.detail}"
    return f"{check.name} = {value}, needs {threshold}"


def why_lines(verdict: GateVerdict) -> list[str]:
    """Why the verdict is what it is: the rule that combines the checks, the checks that
    decided it with their numbers, then every check with its value and threshold."""
    states = [_check_state(c) for c in verdict.checks]
    failed = [c for c, s in zip(verdict.checks, states, strict=True) if not c.passed]
    undecided = [c for c, s in zip(verdict.checks, states, strict=True) if s == "inconclusive"]
    gated = sum(s != "reported" for s in states)
    tasks = {f"{t.task}: {t.metric} ({t.decision.rule})": t for t in verdict.tasks}
    lines = [f"### Why it {'passes' if verdict.passed else 'fails'}", ""]
    rule = (
        "The gate passes only when every gated check passes "
        f"({gated} gated, {len(states) - gated} reported only)."
    )
    if failed:
        reasons = "; ".join(_failure(c, tasks) for c in failed)
        lines.append(f"{rule} **{len(failed)} failed**: {reasons}.")
    else:
        lines.append(f"{rule} All {gated} passed.")
    if undecided:
        counted = verdict.policy.inconclusive
        names = ", ".join(c.name for c in undecided)
        lines.append(
            f"\n**Inconclusive: {names}**, counted as {counted} (`gates.inconclusive`): the "
            "items could neither show a loss beyond the margin nor rule one out (see Why below "
            "the task table for the loss each task can detect)"
            + ("; the distribution checks decide." if counted == "pass" else ".")
        )
    lines += [
        "",
        f"**{len(verdict.checks) - len(failed)}/{len(verdict.checks)} checks passed**",
        "",
        "| | check | value | threshold | detail |",
        "|---|---|---|---|---|",
    ]
    for check, state in zip(verdict.checks, states, strict=True):
        value, threshold = _check_cells(check, tasks)
        detail = "" if check.detail == NO_THRESHOLD else check.detail.replace("|", "\\|")
        lines.append(
            f"| {_CHECK_MARK[state]} {state} | {check.name} | {value} | {threshold} | {detail} |"
        )
    return lines


def to_markdown(verdict: GateVerdict) -> str:
    """A Markdown summary: outcome, per-task table and why, divergence, shadow, failures."""
    status = "PASS ✅" if verdict.passed else "FAIL ❌"
    lines = [
        f"## kiln gate: {status}",
        "",
        f"- candidate: `{_who(verdict.candidate)}`",
        f"- baseline: `{_who(verdict.baseline)}`",
        f"- {_rule_line(verdict)}",
        "",
    ]
    if verdict.tasks:
        lines += [
            "| task | metric | baseline | candidate | recovery | Δ ± se | lower bound | "
            "flips r→w / w→r | loss [bounds] | detects | outcome | pass |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for t in verdict.tasks:
            d = t.decision
            lines.append(
                f"| {t.task} | {t.metric} | {_num(t.baseline)} ± {_num(t.baseline_stderr)} | "
                f"{_num(t.candidate)} ± {_num(t.candidate_stderr)} | {_num(t.recovery)} | "
                f"{d.diff:+.4f} ± {_num(d.diff_stderr)} | {d.lower_bound:+.4f} | {_flips(t)} | "
                f"{_loss_cell(t)} | {_detects(t)} | {_OUTCOME_MARK[t.outcome]} {t.outcome} | "
                f"{'✅' if d.passed else '❌'} |"
            )
        lines += ["", "Why:", ""]
        for t in verdict.tasks:
            lines.append(f"- {t.task}: {t.decision.explanation}")
            for label, ids in _flipped_items(t):
                lines.append(f"  - {label}: items {', '.join(ids)}")
        lines.append("")
    for p in verdict.perplexity:
        lines.append(
            f"- {p.task} {p.metric}: baseline {_num(p.baseline, 3)}, candidate "
            f"{_num(p.candidate, 3)}, ratio {_num(p.ratio)}"
        )
    if verdict.divergence:
        dv = verdict.divergence
        lines.append(
            f"- KL divergence ({dv.method}, {dv.num_tokens:,} tokens): mean {dv.kl_mean:.5f}, "
            f"p99 {dv.kl_p99:.5f}, top-1 agreement {_pct(dv.top1_agreement)}"
        )
    if verdict.noise_floor:
        lines.append(f"- noise floor: {_floor_text(verdict.noise_floor)}")
    if verdict.shadow:
        s = verdict.shadow
        lines.append(
            f"- shadow ({s.num_requests} requests): exact match {_pct(s.exact_match_rate)}, "
            f"mean shared prefix {s.mean_prefix_chars:.1f} chars, length ratio "
            f"{s.length_ratio:.3f}, format errors {_pct(s.baseline_format_error_rate)} → "
            f"{_pct(s.candidate_format_error_rate)} of {s.num_json_requests} JSON requests, "
            f"TTFT p50 {_ms(s.baseline_latency.ttft_p50)} → {_ms(s.candidate_latency.ttft_p50)}"
            + (
                f"; control ({s.control}) exact match {_pct(s.control_exact_match_rate)}"
                if s.control_exact_match_rate is not None
                else ""
            )
        )
    lines += ["", *why_lines(verdict)]
    for note in verdict.notes:
        lines.append(f"\n> {note}")
    return "\n".join(lines) + "\n"


# --- HTML ---------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#1d1d1f}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.8em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ddd;padding:.3em .6em;
text-align:right;vertical-align:top}th{background:#f4f4f6}td.l,th.l{text-align:left}
.pass{color:#137333}.fail{color:#b3261e}.badge{padding:.2em .7em;border-radius:1em;color:#fff}
.badge.pass{background:#137333}.badge.fail{background:#b3261e}
.diff{display:grid;grid-template-columns:1fr 1fr;gap:.6em;margin-bottom:1.2em}
.diff pre{white-space:pre-wrap;word-break:break-word;background:#f7f7f9;padding:.6em;margin:0;
border:1px solid #e3e3e8;font-size:12.5px}.diff mark{background:#ffd7d5}
.bar{display:inline-block;height:.7em;background:#5b8def}.bar.c{background:#f29e4c}
"""


def _kl_histogram_svg(bins: list[dict[str, Any]]) -> str:
    """Bars of per-token KL counts over log-spaced bins, as inline SVG."""
    width, height, pad = 640, 220, 36
    top = max((b["count"] for b in bins), default=0) or 1
    bar_w = (width - 2 * pad) / max(len(bins), 1)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="KL divergence histogram">',
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" '
        'stroke="#888"/>',
    ]
    for i, b in enumerate(bins):
        h = (height - 2 * pad) * b["count"] / top
        x = pad + i * bar_w
        label = f"≥{b['lo']:g}" if b["hi"] is None else f"<{b['hi']:g}"
        parts.append(
            f'<rect x="{x + 2:.1f}" y="{height - pad - h:.1f}" width="{bar_w - 4:.1f}" '
            f'height="{h:.1f}" fill="#5b8def"><title>{html.escape(label)}: {b["count"]}'
            "</title></rect>"
        )
        parts.append(
            f'<text x="{x + bar_w / 2:.1f}" y="{height - pad + 14}" font-size="10" '
            f'text-anchor="middle">{html.escape(label)}</text>'
        )
        parts.append(
            f'<text x="{x + bar_w / 2:.1f}" y="{height - pad - h - 3:.1f}" font-size="10" '
            f'text-anchor="middle">{b["count"]}</text>'
        )
    parts.append(
        f'<text x="{width / 2}" y="{height - 4}" font-size="11" text-anchor="middle">'
        "per-token KL(baseline ‖ candidate), nats</text></svg>"
    )
    return "".join(parts)


def _diff_html(pair: PairDiff) -> str:
    """Both answers side by side; the text after the first difference is highlighted."""
    cut = pair.prefix_chars

    def side(text: str, error: str | None) -> str:
        if error:
            return f'<pre class="fail">error: {html.escape(error)}</pre>'
        return f"<pre>{html.escape(text[:cut])}<mark>{html.escape(text[cut:])}</mark></pre>"

    return (
        f"<h3>{html.escape(pair.id)} — shared prefix {pair.prefix_chars} chars "
        f"({_pct(pair.agreement)})</h3><pre>{html.escape(pair.prompt)}</pre>"
        f'<div class="diff"><div><b>baseline</b>{side(pair.baseline, pair.baseline_error)}'
        f"</div><div><b>candidate</b>{side(pair.candidate, pair.candidate_error)}</div></div>"
    )


def _row(*cells: str, left: int = 1) -> str:
    return (
        "<tr>"
        + "".join(
            f'<td class="l">{c}</td>' if i < left else f"<td>{c}</td>" for i, c in enumerate(cells)
        )
        + "</tr>"
    )


def to_html(verdict: GateVerdict) -> str:
    """The self-contained HTML report."""
    e = html.escape
    ok = "pass" if verdict.passed else "fail"
    body = [
        f'<h1>kiln gate <span class="badge {ok}">{ok.upper()}</span></h1>',
        "<table>",
        _row("candidate", e(_who(verdict.candidate)), left=2),
        _row("baseline", e(_who(verdict.baseline)), left=2),
        _row("rule", e(_rule_line(verdict).replace("`", "")), left=2),
        _row("created", e(verdict.created_at), left=2),
        "</table>",
    ]
    if verdict.tasks:
        body.append(
            "<h2>Tasks</h2><table><tr><th class=l>task</th><th class=l>metric</th>"
            "<th>baseline</th><th>candidate</th><th class=l></th><th>recovery</th>"
            "<th>Δ ± se</th><th>lower bound</th><th>flips r→w / w→r</th><th>loss [bounds]</th>"
            "<th>detects</th><th>outcome</th><th>pass</th></tr>"
        )
        for t in verdict.tasks:
            d = t.decision
            scale = max(abs(t.baseline), abs(t.candidate), 1e-12)
            bars = (
                f'<span class="bar" style="width:{80 * abs(t.baseline) / scale:.0f}px"></span><br>'
                f'<span class="bar c" style="width:{80 * abs(t.candidate) / scale:.0f}px"></span>'
            )
            body.append(
                _row(
                    e(t.task),
                    e(t.metric),
                    f"{_num(t.baseline)} ± {_num(t.baseline_stderr)}",
                    f"{_num(t.candidate)} ± {_num(t.candidate_stderr)}",
                    bars,
                    _num(t.recovery),
                    f"{d.diff:+.4f} ± {_num(d.diff_stderr)}",
                    f"{d.lower_bound:+.4f}",
                    _flips(t),
                    e(_loss_cell(t)),
                    e(_detects(t)),
                    e(t.outcome),
                    f'<span class="{"pass" if d.passed else "fail"}">'
                    f"{'pass' if d.passed else 'fail'}</span>",
                    left=2,
                )
            )
        body.append("</table><h3>Why</h3><ul>")
        for t in verdict.tasks:
            flips = "".join(
                f"<br>{e(label)}: items {e(', '.join(ids))}" for label, ids in _flipped_items(t)
            )
            body.append(f"<li><b>{e(t.task)}</b>: {e(t.decision.explanation)}{flips}</li>")
        body.append("</ul>")
    if verdict.perplexity:
        body.append(
            "<h2>Perplexity</h2><table><tr><th class=l>task</th><th class=l>metric</th>"
            "<th>baseline</th><th>candidate</th><th>ratio</th></tr>"
        )
        for p in verdict.perplexity:
            body.append(
                _row(
                    e(p.task),
                    e(p.metric),
                    _num(p.baseline, 3),
                    _num(p.candidate, 3),
                    _num(p.ratio),
                    left=2,
                )
            )
        body.append("</table>")
    if verdict.divergence:
        dv = verdict.divergence
        body.append(
            f"<h2>Next-token divergence</h2><p>{e(dv.method)}, {dv.num_tokens:,} tokens: "
            f"KL mean {dv.kl_mean:.5f}, median {dv.kl_median:.5f}, p99 {dv.kl_p99:.5f}, "
            f"max {dv.kl_max:.4f}; top-1 agreement {_pct(dv.top1_agreement)}</p>"
            + _kl_histogram_svg(dv.histogram)
        )
    if verdict.noise_floor:
        body.append(f"<h2>Noise floor</h2><p>{e(_floor_text(verdict.noise_floor))}</p>")
    if verdict.shadow:
        s = verdict.shadow
        bl, cl = s.baseline_latency, s.candidate_latency
        body += [
            f"<h2>Shadow traffic ({s.num_requests} requests)</h2><table>",
            "<tr><th class=l>metric</th><th>baseline</th><th>candidate</th></tr>",
            _row("exact match", "", _pct(s.exact_match_rate)),
            _row("mean shared prefix (chars)", "", _num(s.mean_prefix_chars, 1)),
            _row("mean shared prefix (tokens)", "", _num(s.mean_prefix_tokens, 1)),
            _row("median first divergence (char)", "", _num(s.median_first_divergence, 1)),
            _row("length ratio", "", _num(s.length_ratio, 3)),
            _row(
                f"format errors ({s.num_json_requests} JSON requests)",
                _pct(s.baseline_format_error_rate),
                _pct(s.candidate_format_error_rate),
            ),
            _row("errors", _pct(s.baseline_error_rate), _pct(s.candidate_error_rate)),
            _row(
                "TTFT p50 / p99",
                f"{_ms(bl.ttft_p50)} / {_ms(bl.ttft_p99)}",
                f"{_ms(cl.ttft_p50)} / {_ms(cl.ttft_p99)}",
            ),
            _row(
                "TPOT p50 / p99",
                f"{_ms(bl.tpot_p50)} / {_ms(bl.tpot_p99)}",
                f"{_ms(cl.tpot_p50)} / {_ms(cl.tpot_p99)}",
            ),
            "</table>",
        ]
        if s.worst:
            body.append("<h2>Worst shadow differences</h2>")
            body += [_diff_html(p) for p in s.worst]
    body.append(
        "<h2>Checks</h2><table><tr><th class=l>check</th><th>value</th>"
        "<th>threshold</th><th class=l>result</th><th class=l>detail</th></tr>"
    )
    for c in verdict.checks:
        result = f'<span class="{"pass" if c.passed else "fail"}">{"pass" if c.passed else "FAIL"}'
        body.append(
            _row(
                e(c.name),
                _num(c.value),
                e(f"{c.op} {_num(c.threshold)}"),
                result + "</span>",
                e(c.detail),
            )
        )
    body.append("</table>")
    if verdict.notes:
        body.append("<h2>Notes</h2><ul>" + "".join(f"<li>{e(n)}</li>" for n in verdict.notes))
        body.append("</ul>")
    if verdict.tools:
        body.append("<h2>Tools</h2><table>")
        body += [_row(e(k), e(str(v)), left=2) for k, v in sorted(verdict.tools.items())]
        body.append("</table>")
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        # No scripts and no external assets: a browser reports any attempt as a CSP error.
        '<meta http-equiv="Content-Security-Policy" '
        "content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">"
        f"<title>kiln gate: {ok}</title><style>{_CSS}</style></head><body>"
        + "\n".join(body)
        + "</body></html>\n"
    )


def write_reports(verdict: GateVerdict, out_dir: str | Path) -> dict[str, Path]:
    """Write gate.json, gate.md and gate.html into out_dir; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": verdict.write(out), "markdown": out / MARKDOWN, "html": out / HTML}
    paths["markdown"].write_text(to_markdown(verdict))
    paths["html"].write_text(to_html(verdict))
    return paths
