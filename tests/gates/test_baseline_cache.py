"""The baseline's evaluation is cached, and a control measures the noise floor (tiny model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.gates.measure.eval_cache import EvaluationCache, decode, encode, evaluation_key
from kiln.gates.measure.tasks import TaskResult
from kiln.gates.run import run_gate
from kiln.gates.settings import load_gates
from tests.gates.conftest import build_artifact
from tests.gates.test_gate_e2e import perturbed_copy

GATES = {
    "tasks": ["kiln_ppl", "kiln_mc"],
    "limit": 10,
    "divergence": {"num_texts": 2, "max_seq_len": 32, "top_k": 10},
}


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)


def test_an_evaluation_survives_the_cache_as_it_was(tmp_path: Path) -> None:
    results = {"mc": TaskResult("mc", "multiple_choice", "acc", True, 0.5, {0: 1.0, 7: 0.0})}
    topk = [[{3: -0.1, 9: -2.5}], [{4: -0.7}]]
    cache = EvaluationCache(tmp_path)
    key = evaluation_key({"side": "d" * 64, "limit": 10})
    assert cache.get(key) is None
    cache.put(key, encode(results, topk, [[1, 3], [2, 4]]))
    again = decode(json.loads(json.dumps(cache.get(key))))
    assert again == (results, topk, [[1, 3], [2, 4]])
    assert evaluation_key({"side": "d" * 64, "limit": 11}) != key
    (tmp_path / f"{key}.json").write_text("{half a fi")
    assert cache.get(key) is None  # unreadable: evaluated again


def test_the_baseline_is_evaluated_once_and_the_control_sets_the_noise_floor(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_GATE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("KILN_DTYPE", "bfloat16")  # the candidate's compute dtype, anywhere
    noisy = perturbed_copy(tiny_llama, tmp_path / "noisy", scale=0.05)
    art = build_artifact(tmp_path / "arts", name="noisy", model_dir=noisy)
    gates = load_gates(GATES, "test")

    def gate(out: str) -> tuple[list[str], dict]:
        said: list[str] = []
        run_gate(str(art), str(tiny_llama), gates, tmp_path / out, progress=said.append)
        return said, json.loads((tmp_path / out / "gate.json").read_text())

    said, first = gate("one")
    assert any(m.startswith("baseline: kiln_ppl") for m in said)
    assert any(
        m.startswith("control: the baseline served by kiln's runtime in bfloat16") for m in said
    )
    assert len(list((tmp_path / "cache").glob("*.json"))) == 2
    floor = first["noise_floor"]
    assert floor["dtype"] == "bfloat16" and set(floor["perplexity_ratio"]) == {"kiln_ppl"}
    assert 0 < floor["divergence"]["kl_mean"] < first["divergence"]["kl_mean"]
    assert "× the control's" in next(
        c["detail"] for c in first["checks"] if c["name"] == "KL divergence mean"
    )
    (mc,) = first["tasks"]
    assert len(mc["item_scores"]) == 10 and "kiln_mc" in floor["flip_rate"]

    said, second = gate("two")
    assert not any(m.startswith(("baseline: kiln", "control: the")) for m in said)
    assert sum("cached evaluation" in m for m in said) == 2
    for key in ("tasks", "perplexity", "divergence", "noise_floor", "passed"):
        assert second[key] == first[key]


def test_the_control_is_the_baseline_computed_exactly_as_the_candidate_is(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Shipping the baseline's own weights unchanged is lossless as shipped: such a candidate
    lands exactly on the noise floor, in whichever dtype the runtime computes."""
    monkeypatch.setenv("KILN_GATE_CACHE", str(tmp_path / "cache"))
    same = build_artifact(tmp_path / "arts", name="same", model_dir=tiny_llama)
    for setting in ("auto", "float32"):
        gates = load_gates({**GATES, "noise_floor": setting}, "test")
        verdict = run_gate(str(same), str(tiny_llama), gates, tmp_path / setting).verdict
        floor, divergence = verdict.noise_floor, verdict.divergence
        assert floor is not None and divergence is not None
        assert floor.control == f"the baseline served by kiln's runtime in {floor.dtype}"
        assert floor.divergence == divergence
        assert floor.perplexity_ratio == {p.task: p.ratio for p in verdict.perplexity}
        assert floor.flip_rate == {t.task: t.flip_rate for t in verdict.tasks}
    assert floor.dtype == "float32"
