"""NVFP4 through ModelOpt on a CPU: ModelOpt calibrates and exports it here, and kiln reads
the export back and runs it with its own emulation of Blackwell's FP4 numerics
(runtime/formats/nvfp4.py), checked against ModelOpt's own NVFP4 quantiser (`NVFP4QTensor`, whose
quantise/dequantise is plain torch; its fake quantiser needs CUDA).

End to end the served model follows the exported model as `load_checkpoint` rebuilds it
(dequantised weights, activations fake-quantised by hooks): FP4 rounding of activations is
discontinuous, and norms, RoPE and attention run in another order than transformers runs them,
so now and then a value lands on the other side of a rounding step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kiln.quant.backends.modelopt import load_checkpoint
from kiln.quant.quantize import quantize
from kiln.quant.schemes import resolve
from kiln.quant.spec import CalibrationSpec, QuantSpec
from kiln.runtime import Engine
from kiln.runtime.engine.layers.nvfp4 import Nvfp4Linear
from kiln.runtime.formats import nvfp4
from kiln.runtime.formats.checkpoint import open_checkpoint
from kiln.runtime.formats.weights import dequantize
from tests.runtime.conftest import assert_close_to_reference

NVFP4 = QuantSpec(method="nvfp4", weight_bits=4, activations="nvfp4", backend="modelopt")


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # two shared cores: as the runtime tests run


@pytest.fixture(scope="module")
def exported(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("nvfp4")
    quantize(tiny_llama, resolve(NVFP4), CalibrationSpec(num_samples=8, max_seq_len=64), out)
    return out


def _modelopt_roundtrip(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    q, block, scale_2 = NVFP4QTensor.quantize(x, 16, weights_scaling_factor_2=global_scale)
    return q.dequantize(
        dtype=torch.float32, scale=block, double_scale=scale_2, block_sizes={-1: 16}
    )


@pytest.mark.parametrize("spread", [1e-3, 1.0, 300.0])
def test_activation_rounding_is_modelopts_nvfp4(spread: float) -> None:
    x = torch.randn(9, 64, generator=torch.Generator().manual_seed(1)) * spread
    x[0, :8] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])  # e2m1 ties
    global_scale = x.abs().max() / (6 * 448)
    assert torch.equal(nvfp4.fake_quantize(x, global_scale), _modelopt_roundtrip(x, global_scale))


def test_the_export_is_nvfp4_and_reads_back_as_modelopt_dequantises_it(exported: Path) -> None:
    from modelopt.torch.quantization.qtensor.nvfp4_tensor import NVFP4QTensor

    ckpt = open_checkpoint(exported)
    assert ckpt.quant.quant_algo == "NVFP4"
    module = "model.layers.1.mlp.down_proj"
    with safe_open(str(exported / "model.safetensors"), "pt") as f:
        packed = f.get_tensor(f"{module}.weight")
        block, scale_2 = (
            f.get_tensor(f"{module}.weight_scale"),
            f.get_tensor(f"{module}.weight_scale_2"),
        )
    shape = (packed.shape[0], packed.shape[1] * 2)
    theirs = NVFP4QTensor(shape, torch.float32, packed).dequantize(
        dtype=torch.float32, scale=block, double_scale=scale_2, block_sizes={-1: 16}
    )
    ours = dequantize(ckpt.linear(module), torch.float32)
    assert torch.allclose(ours, theirs, rtol=1e-6, atol=0)


def test_each_served_linear_computes_what_the_exported_model_does(exported: Path) -> None:
    ours = Engine.from_pretrained(exported).model.layers[0]
    assert isinstance(ours.qkv, Nvfp4Linear) and isinstance(ours.down, Nvfp4Linear)
    reference, _ = load_checkpoint(exported)
    layer = reference.model.layers[0]
    x = torch.randn(7, 128, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():  # the reference's hooks fake-quantise its inputs
        pairs = [
            (ours.gate_up(x), torch.cat([layer.mlp.gate_proj(x), layer.mlp.up_proj(x)], -1)),
            (ours.o_proj(x), layer.self_attn.o_proj(x)),
        ]
    for got, expected in pairs:
        assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_served_nvfp4_export_matches_the_exported_model(exported: Path) -> None:
    engine = Engine.from_pretrained(exported)
    reference, _ = load_checkpoint(exported)
    assert_close_to_reference(engine, reference, 0.1, 0.02)
