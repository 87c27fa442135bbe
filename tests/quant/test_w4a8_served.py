"""W4A8 AWQ through ModelOpt, served by kiln's runtime as the GPU computes it
(runtime/formats/w4a8.py):
FP8 weights e4m3(int4 code × fp16 group scale / weight_scale_2) times FP8 activations rounded
with the static input scale.

Checked three ways: against a reference built here from the exported tensors alone; against
ModelOpt's own fake quantisers (its calibrated W4A8 model runs on a CPU: int4 blocks, then
per-tensor FP8, for weights; FP8 for inputs); and end to end against the exported model as
`load_checkpoint` rebuilds it (which the quantisation report measures).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoTokenizer

from kiln.quant.backends.modelopt import load_checkpoint
from kiln.quant.calibration import load_texts, tokenize
from kiln.runtime import Engine
from kiln.runtime.engine.layers.fp8 import Fp8Linear
from kiln.runtime.engine.layers.linear import PreScaledLinear
from kiln.runtime.formats.checkpoint import open_checkpoint
from kiln.runtime.formats.weights import (
    ActivationScheme,
    LinearWeights,
    WeightScheme,
    effective_weight,
)
from tests.quant.conftest import CALIBRATION, Quantised, export_modelopt_awq
from tests.runtime.conftest import assert_close_to_reference

KEY = "modelopt-w4a8-awq-g64"


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    torch.set_num_threads(1)  # two shared cores: as the runtime tests run


def _reference_weight(tensors: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    """TensorRT-LLM's W4A8 weight from the exported tensors: nibbles (low = even output row)
    → int4 codes; group scale in float16 divided by weight_scale_2; code × scale in float16;
    FP8; × weight_scale_2."""
    packed = tensors["weight"].to(torch.int32)
    nibbles = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1, packed.shape[1])
    codes = torch.where(nibbles >= 8, nibbles - 16, nibbles).to(torch.float16)
    second = tensors["weight_scale_2"].float()
    scale = (tensors["weight_scale"].half().float() / second).half()
    product = codes * scale.repeat_interleave(group, dim=1)
    return product.float().to(torch.float8_e4m3fn).float() * second


def _tensors(model_dir: Path, module: str) -> dict[str, torch.Tensor]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        names = [k for k in f.keys() if k.startswith(module)]  # noqa: SIM118 (no __iter__)
        return {k.rsplit(".", 1)[1]: f.get_tensor(k) for k in names}


def test_each_served_linear_is_the_fp8_gemm_built_from_the_exported_tensors(
    quantised: Quantised,
) -> None:
    model_dir, _ = quantised(KEY)
    layer = Engine.from_pretrained(model_dir).model.layers[0]
    assert isinstance(layer.qkv, Fp8Linear)
    assert isinstance(layer.down, PreScaledLinear) and isinstance(layer.down.inner, Fp8Linear)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(0))
    t = _tensors(model_dir, "model.layers.0.mlp.down_proj.")
    inputs = x * t["pre_quant_scale"]
    scale = t["input_scale"].float()
    inputs = (inputs / scale).clamp(-448, 448).to(torch.float8_e4m3fn).float() * scale
    expected = inputs @ _reference_weight(t, 64).t()
    with torch.no_grad():
        got = layer.down(x).float()
    assert (got - expected).abs().max() <= 1e-5 * expected.abs().max()


def test_weight_fp8_rounding_is_part_of_what_is_served(quantised: Quantised) -> None:
    """The int4 values are not what the GPU multiplies: most land between FP8 steps."""
    ckpt = open_checkpoint(quantised(KEY)[0])
    module = "model.layers.1.mlp.up_proj"
    stored, served = ckpt.linear(module), ckpt.served_linear(module)
    assert stored.weight.dtype == torch.int8 and served.weight.dtype == torch.float8_e4m3fn
    reference = _reference_weight(_tensors(ckpt.dir, f"{module}."), 64)
    assert torch.equal(served.weight.float() * served.scale, reference)


def test_activation_rounding_is_modelopts_fp8_fake_quantiser() -> None:
    """Bit for bit, ties and saturation included, where the scale is a power of two (ModelOpt
    multiplies by 448 / amax, the export divides by amax / 448: elsewhere one float32 ulp
    may put a value on the other side of an FP8 midpoint)."""
    from modelopt.torch.quantization.tensor_quant import fp8_eager

    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(2)) * 3
    x[0, :6] = torch.tensor([1.0625, 1.1875, -0.5312, 17.0, 600.0, -1e4])  # ties; beyond 448
    static = ActivationScheme("float", 8, "tensor", dynamic=False)
    identity = LinearWeights(
        WeightScheme("float", 8, "tensor", activations=static),
        torch.eye(64).to(torch.float8_e4m3fn),
        torch.ones(64, 1),
        input_scale=torch.tensor(0.5),
    )
    layer = Fp8Linear(identity, torch.float32, torch.device("cpu"))
    assert torch.equal(layer(x), fp8_eager(x, torch.tensor(0.5 * 448)))


def test_served_weights_are_modelopts_fake_quantised_weights(tiny_llama: Path, tmp_path) -> None:
    """o_proj and down_proj keep their own pre_quant_scale in the export, so what is served
    there must be ModelOpt's calibrated W4A8 weight (int4 blocks, then per-tensor FP8) ×
    pre_quant_scale, up to the float16 the GPU holds group scales in."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    ids = tokenize(load_texts(CALIBRATION), tokenizer, CALIBRATION.max_seq_len)
    expected = export_modelopt_awq(tiny_llama, KEY, ids, tmp_path)
    ckpt = open_checkpoint(tmp_path)
    for name, want in expected.items():
        got = effective_weight(ckpt.served_linear(name), torch.float32)
        step = want.abs() / 8  # one FP8 step: 3 mantissa bits
        assert ((got - want).abs() <= step + 1e-7).all(), name
        assert (got == want).float().mean() > 0.95, name


def test_served_w4a8_export_matches_the_exported_model(quantised: Quantised) -> None:
    model_dir, _ = quantised(KEY)
    engine = Engine.from_pretrained(model_dir)
    reference, _ = load_checkpoint(model_dir)
    assert_close_to_reference(engine, reference, 0.1, 0.02)
