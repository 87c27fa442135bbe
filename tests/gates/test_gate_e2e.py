"""End to end on a tiny real model: artifact through the runtime vs the float source."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from kiln.compiler.cli.gate import gate, promote
from kiln.gates.releases import Registry
from kiln.gates.run import run_gate
from kiln.gates.settings import load_gate_file
from tests.gates.conftest import build_artifact

GATE_FILE = """
gates:
  tasks: [kiln_ppl, kiln_mc, kiln_qa]
  limit: 12
  thresholds: {kl_mean: 0.001}
  divergence: {num_texts: 3, max_seq_len: 48, top_k: 10}
  shadow: {traffic: traffic.jsonl, max_tokens: 8}
"""
TRAFFIC = [
    {"id": "a", "request": {"prompt": "Permission is hereby granted", "max_tokens": 8}},
    {"id": "b", "request": {"messages": [{"role": "user", "content": "Reply in JSON."}]}},
]


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def gate_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("gate")
    (root / "gate.yaml").write_text(GATE_FILE)
    (root / "traffic.jsonl").write_text("".join(json.dumps(r) + "\n" for r in TRAFFIC))
    return root


def perturbed_copy(model_dir: Path, into: Path, scale: float) -> Path:
    """The same checkpoint with Gaussian noise added to every weight matrix."""
    shutil.copytree(model_dir, into)
    weights = load_file(into / "model.safetensors")
    generator = torch.Generator().manual_seed(0)
    for name, tensor in weights.items():
        if tensor.ndim == 2:
            noise = torch.randn(tensor.shape, generator=generator) * tensor.std() * scale
            weights[name] = tensor + noise
    save_file(weights, into / "model.safetensors", metadata={"format": "pt"})
    return into


def test_an_unchanged_model_passes_every_check(
    tiny_llama: Path, gate_dir: Path, tmp_path: Path
) -> None:
    art = build_artifact(tmp_path / "arts", name="tiny", model_dir=tiny_llama)
    gates = load_gate_file(gate_dir / "gate.yaml")
    with Registry(tmp_path / "r.db") as reg:
        outcome = run_gate(
            str(art), str(tiny_llama), gates, tmp_path / "out", base_dir=gate_dir, registry=reg
        )
        verdict = outcome.verdict
        assert verdict.passed, [(c.name, c.value, c.detail) for c in verdict.failed_checks]
        assert {t.task for t in verdict.tasks} == {"kiln_mc", "kiln_qa"}
        for task in verdict.tasks:  # runtime and transformers agree item by item
            assert task.num_items == 12 and task.flip_rate == 0.0
            assert task.baseline == task.candidate
        (ppl,) = verdict.perplexity
        assert ppl.ratio == pytest.approx(1.0, abs=1e-4)
        assert verdict.divergence is not None and verdict.divergence.kl_mean < 1e-6
        assert verdict.divergence.top1_agreement == 1.0
        assert verdict.shadow is not None and verdict.shadow.exact_match_rate == 1.0
        # the shadow noise floor: the float source replayed at another compute precision
        assert verdict.shadow.control_exact_match_rate is not None
        assert (verdict.shadow.control or "").startswith("the baseline computed in")
        assert verdict.candidate["kind"] == "artifact" and verdict.baseline["kind"] == "source"
        assert set(verdict.tools) >= {"lm-eval", "torch", "transformers"}
        # the passing run against the float source lets the artifact into an empty channel
        event = reg.promote(art, "prod", "tiny release")
        assert event["digest"] == verdict.candidate["digest"]


def test_a_damaged_model_fails_through_the_cli_with_exit_1(
    tiny_llama: Path, gate_dir: Path, tmp_path: Path
) -> None:
    noisy = perturbed_copy(tiny_llama, tmp_path / "noisy", scale=0.5)
    art = build_artifact(tmp_path / "arts", name="noisy", model_dir=noisy)
    db = str(tmp_path / "r.db")
    result = CliRunner().invoke(
        gate,
        [
            str(art),
            "--baseline",
            str(tiny_llama),
            "--gate-file",
            str(gate_dir / "gate.yaml"),
            "--out",
            str(tmp_path / "out"),
            "--registry",
            db,
        ],
    )
    assert result.exit_code == 1, result.stderr
    data = json.loads((tmp_path / "out" / "gate.json").read_text())
    failed = {c["name"] for c in data["checks"] if not c["passed"]}
    assert "KL divergence mean" in failed and "shadow: exact match" in failed
    assert data["divergence"]["kl_mean"] > 0.001
    refused = CliRunner().invoke(promote, [str(art), "--channel", "prod", "--registry", db])
    assert refused.exit_code == 1 and "failed" in refused.stderr
