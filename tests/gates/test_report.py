"""Reports: Markdown for CI logs, and a self-contained HTML page rendered in Chromium."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from kiln.gates.decide.checks import exact_match_check
from kiln.gates.decide.compare import Comparisons, PerplexityComparison, compare_task
from kiln.gates.decide.rules import GatePolicy
from kiln.gates.decide.verdict import GateVerdict, build_verdict
from kiln.gates.measure.divergence import summarize
from kiln.gates.measure.shadow import LatencyStats, PairDiff, summarize_pairs
from kiln.gates.report import to_markdown, write_reports
from kiln.runtime.formats.side_answer import SideAnswer

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
HOSTILE = '<script>alert("x")</script> & <img src="http://example.com/x.png">'


def full_verdict() -> GateVerdict:
    policy = GatePolicy()
    base = {i: float(i % 3 != 0) for i in range(60)}
    cand = {**base, 0: 1.0, 1: 0.0, 2: 0.0}
    pairs = [
        PairDiff(
            "r1", "Say hi", "hello there", "hello there", True, 11, 3, None, False, None, None
        ),
        PairDiff("r2", HOSTILE, '{"a": 1}', HOSTILE, False, 0, 0, 0, True, True, False),
    ]
    responses = [SideAnswer("x", ttft_s=0.01, tpot_s=0.002)] * 2
    shadow = summarize_pairs(pairs, responses, responses)
    kl = np.array([0.0, 1e-4, 5e-3, 0.02, 0.2, 2.5, 7.0])
    return build_verdict(
        {"spec": "art/", "kind": "artifact", "name": "cand", "digest": "c" * 64},
        {"spec": "http://h/v1", "kind": "http", "name": "http://h/v1", "digest": "http://h/v1"},
        policy,
        Comparisons(
            tasks=[compare_task("kiln_mc", "acc", base, cand, policy)],
            perplexity=[PerplexityComparison("kiln_ppl", "word_perplexity", 20.0, 21.0)],
            divergence=summarize(kl, np.array([True] * 6 + [False]), "topk-20"),
            shadow=shadow,
        ),
        tools={"lm-eval": "0.4.13"},
        notes=[HOSTILE],
    )


def test_markdown_summarises_outcome_tables_and_failures() -> None:
    verdict = full_verdict()
    md = to_markdown(verdict)
    assert md.startswith("## kiln gate: FAIL")
    assert "| kiln_mc | acc |" in md and "kiln_ppl word_perplexity" in md
    assert "KL divergence (topk-20, 7 tokens)" in md
    assert "shadow (2 requests): exact match 50.0%" in md
    for check in verdict.failed_checks:
        assert f"| {check.name} |" in md
    assert isinstance(verdict.shadow.baseline_latency, LatencyStats)  # type: ignore[union-attr]


def test_markdown_says_why_with_every_check_its_value_and_threshold() -> None:
    failing = to_markdown(full_verdict())
    assert "### Why it fails" in failing
    assert "**4 failed**: KL divergence mean = 1.3893, needs ≤ 0.0350;" in failing
    assert "| ❌ fail | shadow: exact match | 0.5000 | ≥ 0.9000 |" in failing
    assert "| ➖ reported | KL divergence p99 | 6.7300 | reported only |" in failing
    policy = GatePolicy()
    base = {i: float(i % 3 != 0) for i in range(60)}
    passing = build_verdict(
        {"spec": "a/", "kind": "artifact", "name": "cand", "digest": "c" * 64},
        {"spec": "b/", "kind": "source", "name": "base", "digest": "b" * 64},
        policy,
        Comparisons(
            tasks=[compare_task("kiln_mc", "acc", base, {**base, 0: 1.0, 1: 0.0}, policy)],
            perplexity=[PerplexityComparison("kiln_ppl", "word_perplexity", 20.0, 20.2)],
        ),
    )
    md = to_markdown(passing)
    assert "### Why it passes" in md and "All 2 passed." in md
    assert "**Inconclusive: kiln_mc: acc (mcnemar)**, counted as pass" in md
    assert "| ❔ inconclusive | kiln_mc: acc (mcnemar) | loss +0.00 pt | loss ≤ +2.00 pt |" in md
    assert "| ✅ pass | kiln_ppl: word_perplexity ratio | 1.0100 | ≤ 1.0500 |" in md


def test_reports_are_written_side_by_side(tmp_path: Path) -> None:
    paths = write_reports(full_verdict(), tmp_path)
    assert sorted(p.name for p in paths.values()) == ["gate.html", "gate.json", "gate.md"]
    page = paths["html"].read_text()
    assert "<script" not in page and 'src="http' not in page
    assert "&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;" in page
    assert "<svg" in page and 'aria-label="KL divergence histogram"' in page


@pytest.mark.skipif(
    CHROMIUM is None and not os.environ.get("KILN_CI"),  # .ci/run installs it, then insists
    reason="chromium is not installed (apt-get install chromium)",
)
def test_html_report_renders_in_headless_chromium_without_console_errors(tmp_path: Path) -> None:
    paths = write_reports(full_verdict(), tmp_path)
    assert CHROMIUM is not None
    run = subprocess.run(
        [
            CHROMIUM,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--no-first-run",
            "--enable-logging=stderr",
            "--v=0",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--dump-dom",
            paths["html"].as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    console = [line for line in run.stderr.splitlines() if ":CONSOLE" in line]
    assert console == []
    dom = run.stdout
    assert "<svg" in dom and "<rect" in dom  # the histogram was parsed as SVG
    assert "<script" not in dom  # hostile text stayed text
    assert "Worst shadow differences" in dom and "kiln_mc" in dom


def test_a_check_reported_for_a_reason_shows_the_reason() -> None:
    verdict = full_verdict()
    assert verdict.shadow is not None
    verdict.shadow.control = "the baseline computed in float32"
    verdict.shadow.control_exact_match_rate = 0.25
    verdict.checks = [
        exact_match_check(verdict.shadow, 0.9) if c.name == "shadow: exact match" else c
        for c in verdict.checks
    ]
    md = to_markdown(verdict)
    assert (
        "| ➖ reported | shadow: exact match | 0.5000 | reported only | control (the baseline "
        "computed in float32) 25.0% < 90%: greedy answers diverge on rounding alone" in md
    )
    assert "control (the baseline computed in float32) exact match 25.0%" in md
