"""KL is measured on enough held-out tokens by default, and the reports say how many."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from kiln.gates.measure.divergence_texts import divergence_ids, divergence_texts
from kiln.gates.run import run_gate
from kiln.gates.settings import load_gates
from tests.gates.conftest import build_artifact
from tests.gates.test_gate_e2e import perturbed_copy


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_the_default_texts_give_ten_thousand_scored_tokens(tiny_llama: Path) -> None:
    gates = load_gates({}, "test")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    d = gates.divergence
    texts = divergence_texts(d.texts, d.num_texts, Path.cwd())
    ids = divergence_ids(texts, tokenizer.encode, d.tokens, d.max_seq_len)
    scored = sum(len(i) - 1 for i in ids)
    assert gates.divergence.tokens <= scored < gates.divergence.tokens + 128
    assert all(1 < len(i) <= gates.divergence.max_seq_len for i in ids)
    few = load_gates({"divergence": {"tokens": 300}}, "test").divergence
    few_texts = divergence_texts(few.texts, few.num_texts, Path.cwd())
    assert (
        sum(
            len(i) - 1
            for i in divergence_ids(few_texts, tokenizer.encode, few.tokens, few.max_seq_len)
        )
        < 300 + 128
    )


def test_the_gate_reports_how_many_tokens_kl_was_measured_over(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_GATE_CACHE", str(tmp_path / "cache"))
    noisy = perturbed_copy(tiny_llama, tmp_path / "noisy", scale=0.05)
    art = build_artifact(tmp_path / "arts", name="noisy", model_dir=noisy)
    gates = load_gates({"tasks": [], "noise_floor": "off"}, "test")
    run_gate(str(art), str(tiny_llama), gates, tmp_path / "out")
    report = json.loads((tmp_path / "out" / "gate.json").read_text())
    tokens = report["divergence"]["num_tokens"]
    assert tokens >= 10_000
    assert f"(topk-20, {tokens:,} tokens): mean" in (tmp_path / "out" / "gate.md").read_text()


def test_texts_too_short_for_the_tokens_asked_are_said_so(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_GATE_CACHE", str(tmp_path / "cache"))
    texts = tmp_path / "texts.txt"
    texts.write_text("The lighthouse keeper climbed the stairs.\n\nBread rises in a warm room.")
    art = build_artifact(tmp_path / "arts", name="same", model_dir=tiny_llama)
    gates = load_gates(
        {"tasks": [], "noise_floor": "off", "divergence": {"texts": str(texts)}}, "test"
    )
    outcome = run_gate(str(art), str(tiny_llama), gates, tmp_path / "out")
    assert outcome.verdict.divergence is not None
    n = outcome.verdict.divergence.num_tokens
    assert any(
        f"KL measured over {n:,} tokens, fewer than the 10,240 asked" in m for m in outcome.notes
    )
