"""The unquantised layer on CPU: oneDNN's packed weight, held once in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kiln.runtime.linear import DenseLinear, LinearWeights, WeightScheme

CPU = torch.device("cpu")
bf16_packing = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available() or not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
    reason="oneDNN cannot run bf16 GEMMs on this CPU",
)


def weights(out_features: int, in_features: int, bias: bool) -> LinearWeights:
    generator = torch.Generator().manual_seed(out_features)
    weight = torch.randn(out_features, in_features, generator=generator)
    b = torch.randn(out_features, generator=generator) if bias else None
    return LinearWeights(WeightScheme(), weight, bias=b)


@bf16_packing
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_layer_holds_its_weight_once_and_computes_f_linear(bias: bool) -> None:
    w = weights(96, 64, bias)
    layer = DenseLinear(w, torch.bfloat16, CPU)
    assert layer.weight is None and layer.packed is not None  # no plain second copy
    assert layer.weight_bytes() == 96 * 64 * 2 + (96 * 2 if bias else 0)
    weight = w.weight.bfloat16()
    b = None if w.bias is None else w.bias.bfloat16()
    for rows in (0, 1, 3, 4, 32):
        x = torch.randn(rows, 64).bfloat16()
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
        expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
        torch.testing.assert_close(got.float(), expected, atol=0.1, rtol=0.02)


def test_float32_layer_keeps_the_one_row_gemv_weight() -> None:
    w = weights(96, 64, bias=True)
    layer = DenseLinear(w, torch.float32, CPU)
    assert layer.weight is not None
    for rows in (1, 4, 32):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, w.weight, w.bias))
