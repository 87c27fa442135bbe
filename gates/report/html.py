"""The gate's self-contained HTML page: no scripts, no external assets (a CSP forbids them),
the KL histogram as inline SVG, the worst shadow differences side by side."""

from __future__ import annotations

import html
from typing import Any

from kiln.gates.decide.verdict import GateVerdict
from kiln.gates.measure.shadow import PairDiff
from kiln.gates.report.cells import (
    ENGINE_VS_RUNTIME_HEADER,
    detects,
    engine_lines,
    engine_vs_runtime_rows,
    flipped_items,
    flips_cell,
    floor_text,
    loss_cell,
    ms,
    num,
    pct,
    rule_line,
    who,
)

HTML = "gate.html"
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
        f"({pct(pair.agreement)})</h3><pre>{html.escape(pair.prompt)}</pre>"
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


def _tasks(verdict: GateVerdict) -> list[str]:
    """The tasks table and why each task passed or failed."""
    e = html.escape
    if not (verdict.tasks):
        return []
    body: list[str] = []
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
                f"{num(t.baseline)} ± {num(t.baseline_stderr)}",
                f"{num(t.candidate)} ± {num(t.candidate_stderr)}",
                bars,
                num(t.recovery),
                f"{d.diff:+.4f} ± {num(d.diff_stderr)}",
                f"{d.lower_bound:+.4f}",
                flips_cell(t),
                e(loss_cell(t)),
                e(detects(t)),
                e(t.outcome),
                f'<span class="{"pass" if d.passed else "fail"}">'
                f"{'pass' if d.passed else 'fail'}</span>",
                left=2,
            )
        )
    body.append("</table><h3>Why</h3><ul>")
    for t in verdict.tasks:
        flips = "".join(
            f"<br>{e(label)}: items {e(', '.join(ids))}" for label, ids in flipped_items(t)
        )
        body.append(f"<li><b>{e(t.task)}</b>: {e(t.decision.explanation)}{flips}</li>")
    body.append("</ul>")
    return body


def _perplexity(verdict: GateVerdict) -> list[str]:
    """The perplexity table."""
    e = html.escape
    if not (verdict.perplexity):
        return []
    body: list[str] = []
    body.append(
        "<h2>Perplexity</h2><table><tr><th class=l>task</th><th class=l>metric</th>"
        "<th>baseline</th><th>candidate</th><th>ratio</th></tr>"
    )
    for p in verdict.perplexity:
        body.append(
            _row(
                e(p.task),
                e(p.metric),
                num(p.baseline, 3),
                num(p.candidate, 3),
                num(p.ratio),
                left=2,
            )
        )
    body.append("</table>")
    return body


def _divergence(verdict: GateVerdict) -> list[str]:
    """Next-token divergence with its KL histogram, and the noise floor."""
    e = html.escape
    body: list[str] = []
    if verdict.divergence:
        dv = verdict.divergence
        body.append(
            f"<h2>Next-token divergence</h2><p>{e(dv.method)}, {dv.num_tokens:,} tokens: "
            f"KL mean {dv.kl_mean:.5f}, median {dv.kl_median:.5f}, p99 {dv.kl_p99:.5f}, "
            f"max {dv.kl_max:.4f}; top-1 agreement {pct(dv.top1_agreement)}</p>"
            + _kl_histogram_svg(dv.histogram)
        )
    if verdict.noise_floor:
        body.append(f"<h2>Noise floor</h2><p>{e(floor_text(verdict.noise_floor))}</p>")
    return body


def _shadow(verdict: GateVerdict) -> list[str]:
    """The shadow comparison's table and its worst differences."""
    if not (verdict.shadow):
        return []
    body: list[str] = []
    s = verdict.shadow
    bl, cl = s.baseline_latency, s.candidate_latency
    body += [
        f"<h2>Shadow traffic ({s.num_requests} requests)</h2><table>",
        "<tr><th class=l>metric</th><th>baseline</th><th>candidate</th></tr>",
        _row("exact match", "", pct(s.exact_match_rate)),
        _row("mean shared prefix (chars)", "", num(s.mean_prefix_chars, 1)),
        _row("mean shared prefix (tokens)", "", num(s.mean_prefix_tokens, 1)),
        _row("median first divergence (char)", "", num(s.median_first_divergence, 1)),
        _row("length ratio", "", num(s.length_ratio, 3)),
        _row(
            f"format errors ({s.num_json_requests} JSON requests)",
            pct(s.baseline_format_error_rate),
            pct(s.candidate_format_error_rate),
        ),
        _row("errors", pct(s.baseline_error_rate), pct(s.candidate_error_rate)),
        _row(
            "TTFT p50 / p99",
            f"{ms(bl.ttft_p50)} / {ms(bl.ttft_p99)}",
            f"{ms(cl.ttft_p50)} / {ms(cl.ttft_p99)}",
        ),
        _row(
            "TPOT p50 / p99",
            f"{ms(bl.tpot_p50)} / {ms(bl.tpot_p99)}",
            f"{ms(cl.tpot_p50)} / {ms(cl.tpot_p99)}",
        ),
        "</table>",
    ]
    if s.worst:
        body.append("<h2>Worst shadow differences</h2>")
        body += [_diff_html(p) for p in s.worst]
    return body


def _engine_vs_runtime(verdict: GateVerdict) -> list[str]:
    """How the serving engine's scores of the candidate differ from kiln's runtime's."""
    rows = engine_vs_runtime_rows(verdict)
    if not rows:
        return []
    e = html.escape
    found = verdict.engine_vs_runtime or {}
    head = "".join(f"<th>{e(h)}</th>" for h in ENGINE_VS_RUNTIME_HEADER)
    body = [f"<h2>Engine vs {e(str(found.get('runtime')))} (reported only)</h2>",
            f"<table><tr>{head}</tr>"]  # fmt: skip
    body += [_row(*(e(c) for c in row), left=2) for row in rows]
    body.append("</table>")
    return body


def _checks(verdict: GateVerdict) -> list[str]:
    """Every check of the verdict."""
    e = html.escape
    body: list[str] = []
    body.append(
        "<h2>Checks</h2><table><tr><th class=l>check</th><th>value</th>"
        "<th>threshold</th><th class=l>result</th><th class=l>detail</th></tr>"
    )
    for c in verdict.checks:
        result = f'<span class="{"pass" if c.passed else "fail"}">{"pass" if c.passed else "FAIL"}'
        body.append(
            _row(
                e(c.name),
                num(c.value),
                e(f"{c.op} {num(c.threshold)}"),
                result + "</span>",
                e(c.detail),
            )
        )
    body.append("</table>")
    return body


def _notes_and_tools(verdict: GateVerdict) -> list[str]:
    """The verdict's notes and the tools that measured it."""
    e = html.escape
    body: list[str] = []
    if verdict.notes:
        body.append("<h2>Notes</h2><ul>" + "".join(f"<li>{e(n)}</li>" for n in verdict.notes))
        body.append("</ul>")
    if verdict.tools:
        body.append("<h2>Tools</h2><table>")
        body += [_row(e(k), e(str(v)), left=2) for k, v in sorted(verdict.tools.items())]
        body.append("</table>")
    return body


def to_html(verdict: GateVerdict) -> str:
    """The self-contained HTML report."""
    e = html.escape
    ok = "pass" if verdict.passed else "fail"
    body = [
        f'<h1>kiln gate <span class="badge {ok}">{ok.upper()}</span></h1>',
        "<table>",
        _row("candidate", e(who(verdict.candidate)), left=2),
        _row("baseline", e(who(verdict.baseline)), left=2),
        _row("rule", e(rule_line(verdict).replace("`", "")), left=2),
        _row("created", e(verdict.created_at), left=2),
        *(_row(e(label), e(text), left=2) for label, text in engine_lines(verdict)),
        "</table>",
    ]
    parts = (_tasks, _perplexity, _divergence, _engine_vs_runtime, _shadow, _checks,
             _notes_and_tools)  # fmt: skip
    for part in parts:
        body += part(verdict)
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        # No scripts and no external assets: a browser reports any attempt as a CSP error.
        '<meta http-equiv="Content-Security-Policy" '
        "content=\"default-src 'none'; style-src 'unsafe-inline'; img-src data:\">"
        f"<title>kiln gate: {ok}</title><style>{_CSS}</style></head><body>"
        + "\n".join(body)
        + "</body></html>\n"
    )
