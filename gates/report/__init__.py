"""The gate's reports: gate.json (the verdict itself), its Markdown summary for CI logs and PR
comments (markdown.py), and its HTML page (html.py)."""

from __future__ import annotations

from pathlib import Path

from kiln.gates.decide.verdict import GateVerdict
from kiln.gates.report.html import HTML, to_html
from kiln.gates.report.markdown import MARKDOWN, to_markdown

__all__ = ["HTML", "MARKDOWN", "to_html", "to_markdown", "write_reports"]


def write_reports(verdict: GateVerdict, out_dir: str | Path) -> dict[str, Path]:
    """Write gate.json, gate.md and gate.html into out_dir; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": verdict.write(out), "markdown": out / MARKDOWN, "html": out / HTML}
    paths["markdown"].write_text(to_markdown(verdict))
    paths["html"].write_text(to_html(verdict))
    return paths
