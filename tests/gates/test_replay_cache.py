"""The baseline's and its control's replayed answers are cached: a second gate against the
same baseline replays only the candidate (tiny model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.gates.measure.shadow import ShadowReport
from kiln.gates.run import run_gate
from kiln.gates.settings import load_gates
from tests.gates.conftest import build_artifact
from tests.gates.test_gate_e2e import perturbed_copy

TRAFFIC = [
    {"id": "a", "request": {"prompt": "Permission is hereby granted", "max_tokens": 8}},
    {"id": "b", "request": {"prompt": "The lighthouse keeper", "max_tokens": 8}},
    {"id": "c", "request": {"messages": [{"role": "user", "content": "Reply in JSON."}]}},
]
SHADOW_ONLY = {"tasks": [], "divergence": {"enabled": False}}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_a_second_gate_replays_only_the_candidate(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_GATE_CACHE", str(tmp_path / "cache"))
    traffic = tmp_path / "traffic.jsonl"
    traffic.write_text("".join(json.dumps(r) + "\n" for r in TRAFFIC))
    arts = [
        build_artifact(tmp_path / "arts", name=f"noisy-{i}", model_dir=perturbed_copy(
            tiny_llama, tmp_path / f"noisy-{i}", scale=0.02 * (i + 1)
        ))
        for i in range(3)
    ]  # fmt: skip

    def gate(art: Path, out: str, **thresholds: float) -> tuple[ShadowReport, list[str]]:
        gates = load_gates({**SHADOW_ONLY, "thresholds": thresholds}, "test")
        outcome = run_gate(str(art), str(tiny_llama), gates, tmp_path / out, traffic=traffic)
        assert outcome.verdict.shadow is not None
        return outcome.verdict.shadow, outcome.notes

    first, notes = gate(arts[0], "one")
    assert first.control_exact_match_rate is not None and not notes
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2  # the baseline's, the control's
    # Timings are measured per run: equal timings mean the baseline's answers were not
    # computed again, and the control's exact match is the one the first gate measured.
    second, notes = gate(arts[1], "two")
    assert second.baseline_latency == first.baseline_latency
    assert second.candidate_latency != first.candidate_latency
    assert second.control_exact_match_rate == first.control_exact_match_rate
    assert any("answers to the 3 requests came from the evaluation cache" in n for n in notes)
    # A gated timing ratio compares two timings of this moment: the baseline replays again.
    third, notes = gate(arts[2], "three", shadow_ttft_p50_ratio=100.0)
    assert third.baseline_latency != first.baseline_latency
    assert not any("evaluation cache" in n for n in notes)
