"""reports/quantization.html: the quantisation report as a page beside its JSON. The summary
(perplexity float and quantised, KL divergence, top-1 agreement, weight error, coverage), a
plot of every linear's relative weight error in model order on a log scale, coloured by kind,
and the worst linears in a table. Self-contained: no scripts, no external assets, the plot as
inline SVG (hand-written: kiln depends on no plotting library, and the page must open from an
artifact on a machine without network).
"""

from __future__ import annotations

import html
import math
import re
from typing import Any

REPORT_HTML = "quantization.html"
WORST = 20  # linears listed in the table
MAX_POINTS = 1500  # past this (large mixtures of experts), one point per layer and kind
KINDS = {"attention": "#5b8def", "mlp": "#f29e4c", "other": "#8e8e93"}
_LAYER = re.compile(r"\.layers\.(\d+)\.")
_CSS = """
body{font:14px/1.45 system-ui,sans-serif;margin:2em auto;max-width:1100px;color:#1d1d1f}
h1{font-size:1.5em}h2{font-size:1.15em;margin-top:1.8em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.6em 0}td,th{border:1px solid #ddd;padding:.3em .6em;
text-align:right}th{background:#f4f4f6}td.l,th.l{text-align:left}.key span{margin-right:1.2em}
"""


def kind(name: str) -> str:
    """A linear's kind by its module path: attention, mlp (experts included) or other."""
    if "attn" in name or "attention" in name:
        return "attention"
    if "mlp" in name or "expert" in name or "feed_forward" in name:
        return "mlp"
    return "other"


def _num(value: Any, digits: int = 4) -> str:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return "—"
    return f"{value:.{digits}g}" if math.isfinite(value) else str(value)


def _points(layers: list[dict[str, Any]]) -> tuple[list[tuple[str, str, float]], bool]:
    """(label, kind, relative error) per plotted point, and whether points are per layer."""
    known = [
        (str(entry.get("name", "")), float(entry["rel_mse"]))
        for entry in layers
        if isinstance(entry.get("rel_mse"), int | float) and math.isfinite(entry["rel_mse"])
    ]
    if len(known) <= MAX_POINTS:
        return [(name, kind(name), err) for name, err in known], False
    worst: dict[tuple[int, str], float] = {}
    for name, err in known:
        found = _LAYER.search(name)
        key = (int(found.group(1)) if found else -1, kind(name))
        worst[key] = max(err, worst.get(key, 0.0))
    ordered = sorted(worst.items())
    return [(f"layer {layer} {k} (worst)", k, err) for (layer, k), err in ordered], True


def plot(layers: list[dict[str, Any]]) -> str:
    """Every linear's relative weight error, in model order, as an inline SVG (log scale)."""
    points, per_layer = _points(layers)
    positive = [err for _, _, err in points if err > 0]
    if not positive:
        return "<p>No linear has a weight error to plot.</p>"
    low = math.floor(math.log10(min(positive)))
    high = max(math.ceil(math.log10(max(positive))), low + 1)
    width, height, left, bottom = 1040, 300, 56, 24
    step = (width - left - 8) / len(points)

    def y(err: float) -> float:
        value = math.log10(err) if err > 0 else low
        return 8 + (height - bottom - 8) * (high - value) / (high - low)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             'role="img" aria-label="relative weight error per linear">']  # fmt: skip
    for decade in range(low, high + 1):
        at = y(10.0**decade)
        parts.append(f'<line x1="{left}" x2="{width - 8}" y1="{at:.1f}" y2="{at:.1f}" '
                     f'stroke="#e3e3e8"/><text x="{left - 6}" y="{at + 4:.1f}" font-size="11" '
                     f'text-anchor="end">1e{decade}</text>')  # fmt: skip
    for i, (label, k, err) in enumerate(points):
        x, top = left + i * step, y(err)
        parts.append(f'<rect x="{x:.2f}" y="{top:.1f}" width="{max(step * 0.8, 0.6):.2f}" '
                     f'height="{height - bottom - top:.1f}" fill="{KINDS[k]}"><title>'
                     f"{html.escape(label)}: {err:.3g}</title></rect>")  # fmt: skip
    axis = "decoder layers, worst linear of each kind" if per_layer else "linears in model order"
    parts.append(f'<text x="{left}" y="{height - 6}" font-size="11">{axis} →</text></svg>')
    key = "".join(f'<span style="color:{c}">■ {k}</span>' for k, c in KINDS.items())
    return f'<div class="key">{key}</div>' + "".join(parts)


def render(report: dict[str, Any], name: str) -> str:
    """The page for one model's report (`name`: the artifact's or draft's name)."""
    title = f"kiln quantisation report: {html.escape(name)}"
    head = (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{title}</title>"
            f"<style>{_CSS}</style></head><body><h1>{title}</h1>")  # fmt: skip
    if "skipped" in report:
        return f"{head}<p>No report: {html.escape(str(report['skipped']))}.</p></body></html>"
    rows = [
        ("perplexity, float → quantised",
         f"{_num(report.get('perplexity_float'))} → {_num(report.get('perplexity_quantized'))}"),
        ("next-token KL divergence, mean (p99)",
         f"{_num(report.get('kl_mean'))} ({_num(report.get('kl_p99'))})"),
        ("top-1 agreement", _num(report.get("top1_agreement"))),
        ("relative weight error, mean (max)",
         f"{_num(report.get('weight_rel_mse_mean'))} ({_num(report.get('weight_rel_mse_max'))})"),
        ("worst linear", html.escape(str(report.get("worst_layer", "—")))),
        ("held-out text", f"{report.get('texts', '—')} texts, {report.get('tokens', '—')} tokens"
                          f" of at most {report.get('max_seq_len', '—')}"),
    ]  # fmt: skip
    coverage = report.get("coverage") or {}
    counts = coverage.get("counts") or {}
    if counts:
        shown = "; ".join(
            f"{html.escape(str(k))}: "
            + ", ".join(f"{n} {html.escape(str(s))}" for s, n in sorted(v.items()))
            for k, v in sorted(counts.items())
            if isinstance(v, dict)
        )
        rows.append(("coverage", shown))
    summary = "".join(f'<tr><th class="l">{k}</th><td class="l">{v}</td></tr>' for k, v in rows)
    layers = [e for e in report.get("layers") or [] if isinstance(e, dict)]
    ranked = sorted(  # a linear whose error is not finite is the worst of all
        (e for e in layers if isinstance(e.get("rel_mse"), int | float)),
        key=lambda e: (math.isfinite(e["rel_mse"]), -float(e["rel_mse"])),
    )[:WORST]
    worst = "".join(
        f'<tr><td class="l">{html.escape(str(e.get("name")))}</td><td>{kind(str(e.get("name")))}'
        f"</td><td>{html.escape(str(e.get('shape', '')))}</td><td>{_num(e['rel_mse'])}</td></tr>"
        for e in ranked
    )
    return (
        f"{head}<h2>Summary</h2><table>{summary}</table>"
        f"<h2>Relative weight error per linear</h2>{plot(layers)}"
        f"<h2>The {len(ranked)} worst linears</h2><table><tr><th class=l>linear</th><th>kind</th>"
        f"<th>shape</th><th>relative error</th></tr>{worst}</table>"
        "<p>From reports/quantization.json beside this page.</p></body></html>"
    )
