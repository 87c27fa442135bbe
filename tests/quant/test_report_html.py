"""reports/quantization.html (quant/report_html.py): a self-contained page whose plot has one
point per linear (one per layer and kind past MAX_POINTS), whose worst-linears table is ranked
by the error, and that says why there is no report where there is none."""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from typing import Any

from kiln.quant.report_html import MAX_POINTS, WORST, kind, render

SVG = "{http://www.w3.org/2000/svg}"


def _report(layers: int, experts: int = 0) -> dict[str, Any]:
    names = []
    for i in range(layers):
        names += [f"model.layers.{i}.self_attn.{p}_proj" for p in "qkvo"]
        names += [f"model.layers.{i}.mlp.experts.{e}.down_proj" for e in range(experts)]
        names += [f"model.layers.{i}.mlp.down_proj"] if not experts else []
    entries = [{"name": n, "rel_mse": 1e-4 * (1 + j), "shape": [8, 8]} for j, n in enumerate(names)]
    entries.append({"name": "model.layers.0.mlp.gate_proj", "rel_mse": math.nan})  # not plotted
    return {"perplexity_float": 12.0, "perplexity_quantized": 12.3, "kl_mean": 0.01,
            "kl_p99": 0.1, "top1_agreement": 0.97, "weight_rel_mse_mean": 1e-3,
            "weight_rel_mse_max": 2e-3, "worst_layer": names[-1], "texts": 4, "tokens": 512,
            "max_seq_len": 128, "layers": entries,
            "coverage": {"counts": {"attention": {"quantised": 4 * layers}}}}  # fmt: skip


def _svg(page: str) -> ET.Element:
    start, end = page.index("<svg"), page.index("</svg>") + len("</svg>")
    return ET.fromstring(page[start:end])  # well-formed XML, or this raises


def test_the_page_plots_every_linear_and_ranks_the_worst() -> None:
    report = _report(layers=3)
    page = render(report, "demo <model>")
    HTMLParser().feed(page)
    assert "<script" not in page and "http://" not in page.replace(SVG[1:-1], "")
    assert "demo &lt;model&gt;" in page and "12 → 12.3" in page
    rects = _svg(page).findall(f"{SVG}rect")
    assert len(rects) == 15  # 3 layers x 5 linears; the NaN one is not a point
    assert rects[0].find(f"{SVG}title").text.startswith("model.layers.0.self_attn.q_proj")
    rows = page.split("worst linears")[1]
    assert rows.index("gate_proj") < rows.index("model.layers.2.mlp.down_proj")  # NaN first
    assert rows.index("model.layers.2.mlp.down_proj") < rows.index(
        "model.layers.2.self_attn.o_proj"
    )
    assert rows.count("<tr>") == min(WORST, 16) + 1


def test_a_large_mixture_of_experts_is_plotted_per_layer_and_kind() -> None:
    report = _report(layers=4, experts=MAX_POINTS // 4)
    page = render(report, "moe")
    rects = _svg(page).findall(f"{SVG}rect")
    assert len(rects) == 8  # each layer's worst attention and worst expert linear
    assert "worst linear of each kind" in page
    assert kind("model.layers.0.mlp.experts.3.up_proj") == "mlp"


def test_a_skipped_report_says_why() -> None:
    page = render({"skipped": "imported pre-quantised checkpoint"}, "m")
    assert "No report: imported pre-quantised checkpoint." in page and "<svg" not in page
