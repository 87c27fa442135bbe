"""The streamed model the report runs: the next layer read ahead while one computes, and an
input that several linears read rounded once where they round it alike."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from kiln.quant import streamed_model
from kiln.quant.streamed_model import float_model, quantised_model
from kiln.runtime.base.errors import ArtifactError
from tests.quant.conftest import Quantised


def _ids() -> torch.Tensor:
    return torch.arange(1, 41).reshape(2, 20) % 250


def _logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=_ids()).logits


def test_the_next_layer_is_read_ahead_and_computes_the_same(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every parameter is read once a forward, on the read-ahead thread, never more than the
    layer running and the next one ahead; the logits are those of reading each module as it
    runs."""
    model = float_model(tiny_llama, "cpu", torch.float32)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    reads: list[tuple[str, str]] = []
    ahead_layers: list[set[int]] = []
    real_read, real_start = streamed_model._ReadAhead._read, streamed_model._ReadAhead.start

    def read(self: Any, name: str, dtype: torch.dtype) -> torch.Tensor:
        reads.append((threading.current_thread().name, name))
        return real_read(self, name, dtype)

    def start(self: Any, params: list[tuple[str, torch.dtype]]) -> None:
        real_start(self, params)
        ahead_layers.append({int(n.split(".")[2]) for n in self.pending if ".layers." in n})

    monkeypatch.setattr(streamed_model._ReadAhead, "_read", read)
    monkeypatch.setattr(streamed_model._ReadAhead, "start", start)
    ahead = _logits(model)
    assert sorted(n for _, n in reads) == sorted(names)  # each once
    assert {thread for thread, _ in reads} == {"kiln-ahead_0"}
    assert all(len(layers) <= 2 for layers in ahead_layers)
    assert max(len(layers) for layers in ahead_layers) == 2

    monkeypatch.setattr(streamed_model._ReadAhead, "start", lambda self, params: None)
    reads.clear()
    assert torch.equal(_logits(float_model(tiny_llama, "cpu", torch.float32)), ahead)
    assert not reads  # every module read its own parameters as it ran


def test_a_tensor_missing_ahead_is_named_by_the_forward(tiny_llama: Path, tmp_path: Path) -> None:
    """A parameter that cannot be read ahead raises its own error where the forward needs it."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_llama, broken)
    (shard,) = broken.glob("*.safetensors")
    tensors = load_file(shard)
    del tensors["model.layers.1.mlp.down_proj.weight"]
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ArtifactError, match=r"model\.layers\.1\.mlp\.down_proj\.weight"):
        _logits(float_model(broken, "cpu", torch.float32))


@pytest.mark.parametrize("key", ["llmcompressor-fp8-kv_fp8", "llmcompressor-fp8_dynamic"])
def test_an_input_read_by_several_linears_is_rounded_once(
    tiny_llama: Path, quantised: Quantised, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q, k and v (gate and up) read one tensor and calibration gave them one scale: it is
    rounded once for them, and the logits are those of rounding it for each."""
    checkpoint = quantised(key)[0]
    calls: list[int] = []
    real = streamed_model.SharedInputs.hook

    def counting(self: Any, quantise: Any, rounding: Any) -> Any:
        def counted(x: Any) -> Any:
            calls.append(1)
            return quantise(x)

        return real(self, counted, rounding)

    monkeypatch.setattr(streamed_model.SharedInputs, "hook", counting)
    shared = _logits(quantised_model(checkpoint, "cpu", torch.float32)[0])
    assert len(calls) == 2 * 4  # two layers: q/k/v, o, gate/up, down
    calls.clear()
    with torch.inference_mode():  # no version counters: every linear rounds its own
        model = quantised_model(checkpoint, "cpu", torch.float32)[0]
        assert torch.equal(model(input_ids=_ids()).logits, shared)
    assert len(calls) == 2 * 7
    calls.clear()
    monkeypatch.setattr(streamed_model, "rounding_key", lambda linear: None)
    assert torch.equal(_logits(quantised_model(checkpoint, "cpu", torch.float32)[0]), shared)
    assert len(calls) == 2 * 7


def test_linears_that_round_alike_are_told_apart_from_those_that_do_not() -> None:
    from kiln.runtime.formats.weights import ActivationScheme, LinearWeights, WeightScheme

    fp8 = WeightScheme(type="float", num_bits=8, activations=ActivationScheme(type="float"))

    def linear(scale: Any = None, pqs: Any = None) -> LinearWeights:
        return LinearWeights(fp8, torch.empty(0), input_scale=scale, pre_quant_scale=pqs)

    key = streamed_model.rounding_key
    assert key(linear(torch.tensor(0.5))) == key(linear(torch.tensor(0.5)))
    assert key(linear(torch.tensor(0.5))) != key(linear(torch.tensor(0.25)))
    assert key(linear(torch.tensor(0.5))) != key(linear(torch.tensor(0.5, dtype=torch.bfloat16)))
    assert key(linear()) is not None  # dynamic: the scheme alone decides
    assert key(linear(torch.tensor([0.5, 0.25]))) is None
    assert key(linear(torch.tensor(0.5), torch.ones(4))) is None
