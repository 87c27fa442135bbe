"""search.json, search.md and search.html (a Pareto plot per target: KL divergence against
price, the frontier joined, the winner ringed), and each target's winning recipe
(`winner-<target>.yaml`, the candidate's own recipe). The plot is inline SVG written here:
no plotting library is a dependency of kiln.
"""

from __future__ import annotations

import html
import json
import math
import os
from pathlib import Path
from typing import Any

import yaml

JSON, MARKDOWN, HTML = "search.json", "search.md", "search.html"


def _num(x: float | None, digits: int = 3) -> str:
    return (
        "—" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}g}"
    )


def _loss(q: dict[str, Any]) -> str:
    if q.get("loss") is None:
        return "—"
    return (
        f"{100 * q['loss']:.2f} [{100 * (q.get('loss_lower') or 0):.2f}, "
        f"{100 * (q.get('loss_upper') or 0):.2f}]"
    )


def markdown(answer: dict[str, Any]) -> str:
    lines = [
        f"# kiln search: {answer['recipe']}",
        "",
        f"Machine: {answer['machine']}. Prices are {answer['price_source']}; "
        "measured speed is kiln's runtime decoding on this machine.",
        "",
    ]
    for target, data in answer["targets"].items():
        rows = data["rows"]
        unit = rows[0]["plan"]["unit"] if rows else "$/M output tokens"
        lines += [f"## {target} ({data['gpu']})", ""]
        if data["winner"]:
            lines.append(f"Winner: **{data['winner']}** (the cheapest candidate that passed).")
        elif data["closest"]:
            c = data["closest"]
            lines.append(
                f"Nothing passed; closest: **{c['id']}**, which missed "
                f"{', '.join(c['failed_checks']) or 'the gate'}."
            )
        lines += [
            "",
            f"| candidate | kind | gate | task loss, points [95% bounds] | KL mean | "
            f"ppl ratio | {unit} | tok/s (modelled) | max concurrency | weights/GPU GiB | "
            "frontier | tok/s here (measured) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in sorted(rows, key=lambda r: (r["price"] is None, r["price"] or 0)):
            q, p = r["quality"], r["plan"]
            gate = "pass" if r["passed"] else ("fail (early look)" if r["screened_out"] else "fail")
            lines.append(
                f"| {r['id']} | {r['kind']} | {gate} | {_loss(q)} | {_num(q['kl_mean'])} | "
                f"{_num(q['perplexity_ratio'], 4)} | {_num(r['price'])} | "
                f"{p['tokens_per_s']:,.0f} | "
                f"{p['max_concurrency']} | {p['weight_bytes_per_gpu'] / 2**30:.2f} | "
                f"{'yes' if r['id'] in data['frontier'] else ''} | "
                f"{_num(r['measured_tokens_per_s'])} |"
            )
        lines.append("")
    if answer["refused"]:
        lines += ["## Refused by kiln compile", ""]
        lines += [f"- {cid}: {why}" for cid, why in answer["refused"].items()]
        lines.append("")
    if answer.get("failed"):
        lines += ["## No verdict: the cluster could not run them", ""]
        lines += [f"- {cid}: {why}" for cid, why in answer["failed"].items()]
        lines.append("")
    if answer.get("cluster"):
        lines += where_they_ran(answer)
    early = answer["early_stop"]
    lines += [
        f"Early look: {early['screened_out']} candidate(s) failed on a quarter of the task "
        "items and skipped the full gate.",
        "",
    ]
    if answer["notes"]:
        lines += ["## Notes", "", *(f"- {n}" for n in answer["notes"]), ""]
    return "\n".join(lines)


def where_they_ran(answer: dict[str, Any]) -> list[str]:
    """The cluster's section: its nodes, and each candidate's node, start, length and
    attempts."""
    cluster = answer["cluster"]
    need = ", ".join(f"{v:g} {r}" for r, v in cluster["per_candidate"].items() if v)
    lines = [
        "## Where each candidate ran",
        "",
        f"Ray cluster {cluster['address']}: {'; '.join(cluster['nodes'])}. Each candidate took "
        f"{need}; {cluster['slots']} ran at once.",
        "",
        "| candidate | node | started (UTC) | seconds | attempts | outcome |",
        "|---|---|---|---|---|---|",
    ]
    for c in answer["candidates"]:
        q = c["quality"]
        outcome = ("no verdict" if c.get("failed") else "refused" if c["refused"]
                   else "pass" if q and q["passed"] else "fail")  # fmt: skip
        lines.append(
            f"| {c['id']} | {c.get('node') or 'a serial run'} | {c.get('started') or '—'} | "
            f"{c['seconds']:.0f} | {c.get('attempts') or '—'} | {outcome} |"
        )
    return [*lines, ""]


def plot_svg(data: dict[str, Any], width: int = 560, height: int = 320) -> str:
    """Quality loss (y) against price (x): every candidate a dot (green passed, red failed),
    the frontier joined, the winner ringed."""
    rows = [r for r in data["rows"] if r["price"] is not None and math.isfinite(r["score"])]
    if not rows:
        return "<p>no priced candidate to plot</p>"
    pad = 48
    xs, ys = [r["price"] for r in rows], [r["score"] for r in rows]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min([*ys, 0.0]), max(ys)
    sx = (width - 2 * pad) / ((x1 - x0) or 1)
    sy = (height - 2 * pad) / ((y1 - y0) or 1)

    def at(r: dict[str, Any]) -> tuple[float, float]:
        return pad + (r["price"] - x0) * sx, height - pad - (r["score"] - y0) * sy

    front = sorted((r for r in rows if r["id"] in data["frontier"]), key=lambda r: r["price"])
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">',
        f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" '
        'stroke="#444"/>',
        f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="#444"/>',
        f'<text x="{width / 2}" y="{height - 10}" text-anchor="middle" font-size="12">'
        f"{html.escape(rows[0]['plan']['unit'])} (modelled)</text>",
        f'<text x="14" y="{height / 2}" font-size="12" transform="rotate(-90 14 {height / 2})" '
        'text-anchor="middle">KL divergence from the baseline</text>',
    ]
    if len(front) > 1:
        points = " ".join(f"{x:.1f},{y:.1f}" for x, y in map(at, front))
        parts.append(f'<polyline points="{points}" fill="none" stroke="#5b8def" stroke-width="2"/>')
    for r in rows:
        x, y = at(r)
        colour = "#2e9e4f" if r["passed"] else "#d0453a"
        parts.append(
            f'<circle cx="{x:.1f}" cy="{y:.1f}" r="5" fill="{colour}"><title>'
            f"{html.escape(r['id'])}: {_num(r['price'])}, loss {_num(r['score'])}"
            "</title></circle>"
        )
        parts.append(
            f'<text x="{x + 7:.1f}" y="{y - 7:.1f}" font-size="10">{html.escape(r["id"])}</text>'
        )
        if r["id"] == data["winner"]:
            parts.append(
                f'<circle cx="{x:.1f}" cy="{y:.1f}" r="10" fill="none" stroke="#111" '
                'stroke-width="2"/>'
            )
    parts.append("</svg>")
    return "\n".join(parts)


def html_page(answer: dict[str, Any]) -> str:
    body = [
        f"<h1>kiln search: {html.escape(answer['recipe'])}</h1>",
        f"<p>Machine: {html.escape(answer['machine'])}. Prices are "
        f"{html.escape(answer['price_source'])}.</p>",
    ]
    for target, data in answer["targets"].items():
        won = data["winner"] or "nothing passed"
        body += [
            f"<h2>{html.escape(target)} ({html.escape(data['gpu'])}): winner "
            f"{html.escape(won)}</h2>",
            plot_svg(data),
        ]
    table = markdown(answer).split("\n")
    body.append("<pre>" + html.escape("\n".join(table)) + "</pre>")
    return (
        "<!doctype html><meta charset='utf-8'><title>kiln search</title>"
        "<body style='font-family:sans-serif'>" + "\n".join(body) + "</body>"
    )


def _relocate(recipe: Path, dest: Path) -> None:
    """A candidate's recipe copied to `dest`, its relative `extends` and `output` re-aimed
    from there (the same files, so `kiln compile dest` reproduces the candidate)."""
    data = yaml.safe_load(recipe.read_text())
    for key in ("extends", "output"):
        if isinstance(data.get(key), str) and not Path(data[key]).is_absolute():
            target = (recipe.parent / data[key]).resolve()
            data[key] = os.path.relpath(target, dest.parent)
    header = "".join(
        line + "\n" for line in recipe.read_text().splitlines() if line.startswith("#")
    )
    dest.write_text(header + yaml.safe_dump(data, sort_keys=False))


def write_reports(out_dir: Path, answer: dict[str, Any]) -> None:
    """The three reports and each target's winning recipe, in `out_dir`."""
    for target, data in answer["targets"].items():
        row = next((r for r in data["rows"] if r["id"] == data["winner"]), None)
        dest = out_dir / f"winner-{target}.yaml"
        if row is not None:
            _relocate(Path(row["recipe"]), dest)
            data["winner_recipe"] = str(dest)
        elif dest.exists():
            dest.unlink()  # a resumed search whose winner no longer passes
    (out_dir / JSON).write_text(json.dumps(answer, indent=2) + "\n")
    (out_dir / MARKDOWN).write_text(markdown(answer))
    (out_dir / HTML).write_text(html_page(answer))
