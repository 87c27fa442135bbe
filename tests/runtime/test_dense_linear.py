"""The unquantised layer on CPU: oneDNN's packed weight in bf16 with kiln's AMX tiles beside
it for decode-sized row counts where the CPU has AMX, or kiln's panels for single rows
(within their memory share), or kiln's bf16 panels alone where oneDNN cannot run bf16."""

from __future__ import annotations

import gc
import os

import pytest
import torch
import torch.nn.functional as F

import kiln.runtime.engine.layers.dense as dense
from kiln.runtime.engine import native
from kiln.runtime.engine.layers.dense import DenseLinear
from kiln.runtime.engine.layers.linear import float_linear
from kiln.runtime.formats.weights import LinearWeights, WeightScheme
from tests.runtime.conftest import needs_amx_kernels, needs_avx2_kernels, needs_dpbf16_kernels

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
def test_bf16_layer_packs_for_onednn_with_panels_for_one_row_and_computes_f_linear(
    bias: bool,
) -> None:
    w = weights(96, 64, bias)
    layer = DenseLinear(w, torch.bfloat16, CPU)
    assert layer.weight is None  # no plain float copy
    if native.amx_kernels_available():  # few rows on kiln's AMX kernel, its tiles beside
        assert layer.amx is not None and layer.panels is None and layer.packed is not None
        assert layer.weight_bytes() == layer.amx.nbytes + (96 * 2 if bias else 0)
    elif native.dpbf16_kernels_available():  # every row count on kiln's AVX512-BF16 kernel
        assert layer.pairs is not None and layer.panels is None and layer.packed is None
        assert layer.weight_bytes() == layer.pairs.nbytes + (96 * 2 if bias else 0)
    elif native.avx2_kernels_available():  # single rows on kiln's kernel, its panels beside
        assert layer.panels is not None and layer.panel_max_rows == 1 and layer.packed is not None
        assert layer.weight_bytes() == layer.panels.nbytes + (96 * 2 if bias else 0)
    else:
        assert layer.panels is None
        assert layer.weight_bytes() == 96 * 64 * 2 + (96 * 2 if bias else 0)
    weight = w.weight.bfloat16()
    b = None if w.bias is None else w.bias.bfloat16()
    for rows in (0, 1, 3, 4, 32, dense.AMX_MAX_ROWS + 1, dense.DPBF16_MAX_ROWS + 1, 300):
        x = torch.randn(rows, 64).bfloat16()
        got = layer(x)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
        expected = F.linear(x.float(), weight.float(), None if b is None else b.float())
        torch.testing.assert_close(got.float(), expected, atol=0.1, rtol=0.02)


@bf16_packing
@needs_avx2_kernels
def test_single_row_copies_stay_within_their_share_of_memory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    page, pages = os.sysconf("SC_PAGE_SIZE"), os.sysconf("SC_PHYS_PAGES")
    monkeypatch.setattr(dense, "DPBF16_ONLY", False)  # pairs beside oneDNN's packed weight
    gc.collect()
    held = dense._one_row_held[0]
    # A budget with room for one 96 x 64 bf16 weight's copy (two panels of 64 columns, or
    # three pairs of AMX tiles), not two.
    monkeypatch.setattr(dense, "ONE_ROW_MEMORY_SHARE", page * pages // (held + 2 * 64 * 64 * 2))
    first = DenseLinear(weights(96, 64, bias=False), torch.bfloat16, CPU)
    second = DenseLinear(weights(96, 64, bias=False), torch.bfloat16, CPU)
    assert copy_of(first) is not None
    assert copy_of(second) is None and second.packed is not None  # over budget: oneDNN alone
    x = torch.randn(1, 64).bfloat16()
    torch.testing.assert_close(second(x).float(), first(x).float(), atol=0.05, rtol=0.02)
    del first
    gc.collect()
    assert dense._one_row_held[0] == held  # released with its layer
    third = DenseLinear(weights(96, 64, bias=False), torch.bfloat16, CPU)
    assert copy_of(third) is not None


def copy_of(layer: DenseLinear) -> torch.Tensor | None:
    """The few-row copy a bf16 layer holds beside oneDNN's (AMX tiles, pairs or panels), if
    any."""
    return next((c for c in (layer.amx, layer.pairs) if c is not None), layer.panels)


@needs_amx_kernels
@pytest.mark.parametrize("bias", [False, True])
def test_amx_kernel_is_a_float32_sum_over_bf16_weights(bias: bool) -> None:
    # 70 outputs: two pairs of 16-column blocks and a partial one; 100 inputs: three chunks of
    # 32 k's and a partial one; rows cover one and two tiles of 16 and more than 32.
    w = weights(70, 100, bias)
    weight = w.weight.bfloat16()
    b = None if w.bias is None else w.bias.bfloat16()
    tiles = torch.ops.kiln.amx_pack(weight)
    assert tiles.dtype == torch.bfloat16 and tiles.shape == (3, 4, 2, 16, 16, 2)
    for rows in (0, 1, 2, 15, 16, 17, 31, 32, 33, 70):
        x = torch.randn(rows, 100).bfloat16()
        got = torch.ops.kiln.amx_linear(x, tiles, 70, b)
        assert got.dtype == torch.bfloat16 and got.shape == (rows, 70)
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        # float32 accumulation, then one rounding to bf16 (half an ulp: 2**-8 of the value)
        torch.testing.assert_close(got.double(), exact, atol=1e-3, rtol=2**-8 + 1e-5)


@needs_amx_kernels
def test_amx_kernel_gives_a_row_the_same_bits_in_any_batch() -> None:
    tiles = torch.ops.kiln.amx_pack(weights(64, 600, bias=False).weight.bfloat16())
    batch = torch.randn(45, 600).bfloat16()
    together = torch.ops.kiln.amx_linear(batch, tiles, 64, None)
    for rows in (1, 2, 16, 17, 32, 33):
        assert torch.equal(
            torch.ops.kiln.amx_linear(batch[:rows], tiles, 64, None), together[:rows]
        )


@needs_amx_kernels
def test_amx_kernel_refuses_a_weight_of_another_shape() -> None:
    tiles = torch.ops.kiln.amx_pack(weights(64, 96, bias=False).weight.bfloat16())
    with pytest.raises(RuntimeError, match="a weight from amx_pack with x's K columns"):
        torch.ops.kiln.amx_linear(torch.randn(2, 128).bfloat16(), tiles, 64, None)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] bfloat16"):
        torch.ops.kiln.amx_linear(torch.randn(2, 96), tiles, 64, None)


@needs_dpbf16_kernels
@pytest.mark.parametrize("bias", [False, True])
def test_dpbf16_kernel_is_a_float32_sum_over_bf16_pairs(bias: bool) -> None:
    # 70 outputs: a panel of 64 and a partial one; K = 101 (odd: the last pair padded) and
    # 1,601 (more than one block of k pairs); rows cover tiles of 5 and every remainder.
    for k in (101, 1601):
        w = weights(70, k, bias)
        weight = w.weight.bfloat16()
        b = None if w.bias is None else w.bias.bfloat16()
        pairs = torch.ops.kiln.dpbf16_pack(weight)
        assert pairs.dtype == torch.bfloat16 and pairs.shape == (2, (k + 1) // 2, 64, 2)
        for rows in (0, 1, 2, 3, 4, 5, 6, 9, 33, 70):
            x = torch.randn(rows, k).bfloat16()
            got = torch.ops.kiln.dpbf16_linear(x, pairs, 70, b)
            assert got.dtype == torch.bfloat16 and got.shape == (rows, 70)
            exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
            # float32 accumulation, then one rounding to bf16 (half an ulp: 2**-8 of the value)
            scale = 1e-3 * (k / 100) ** 0.5
            torch.testing.assert_close(got.double(), exact, atol=scale, rtol=2**-8 + 1e-5)


@needs_dpbf16_kernels
def test_dpbf16_kernel_gives_a_row_the_same_bits_in_any_batch() -> None:
    pairs = torch.ops.kiln.dpbf16_pack(weights(130, 1601, bias=False).weight.bfloat16())
    batch = torch.randn(37, 1601).bfloat16()
    together = torch.ops.kiln.dpbf16_linear(batch, pairs, 130, None)
    for rows in (1, 2, 4, 5, 6, 11, 36):
        assert torch.equal(
            torch.ops.kiln.dpbf16_linear(batch[:rows], pairs, 130, None), together[:rows]
        )


@needs_dpbf16_kernels
def test_dpbf16_kernel_refuses_a_weight_of_another_shape() -> None:
    pairs = torch.ops.kiln.dpbf16_pack(weights(64, 96, bias=False).weight.bfloat16())
    with pytest.raises(RuntimeError, match="a weight from dpbf16_pack with x's K columns"):
        torch.ops.kiln.dpbf16_linear(torch.randn(2, 128).bfloat16(), pairs, 64, None)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] bfloat16"):
        torch.ops.kiln.dpbf16_linear(torch.randn(2, 96), pairs, 64, None)


def test_float32_layer_keeps_the_one_row_gemv_weight() -> None:
    w = weights(96, 64, bias=True)
    layer = DenseLinear(w, torch.float32, CPU)
    assert layer.weight is not None
    for rows in (1, 4, 32):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(layer(x), F.linear(x, w.weight, w.bias))


@needs_avx2_kernels
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_kernel_is_a_float32_sum_over_bf16_weights(x_dtype: torch.dtype, bias: bool) -> None:
    # 70 outputs: a full panel of 64 columns and a partial one; rows cover every tile height
    # and more than one block of 48 rows.
    w = weights(70, 96, bias)
    weight = w.weight.bfloat16()
    b = None if w.bias is None else w.bias.bfloat16()
    panels = torch.ops.kiln.bf16_pack(weight)
    assert panels.dtype == torch.bfloat16 and panels.shape == (2, 96, 64)
    for rows in (0, 1, 2, 3, 4, 5, 6, 7, 13, 50, 101):
        x = torch.randn(rows, 96).to(x_dtype)
        got = torch.ops.kiln.bf16_linear(x, panels, 70, b)
        assert got.dtype == x_dtype and got.shape == (rows, 70)
        exact = F.linear(x.double(), weight.double(), None if b is None else b.double())
        # float32 accumulation, then one rounding to the output dtype (half a bf16 ulp is
        # 2**-8 of the value at most)
        rtol, atol = (2**-8 + 1e-5, 1e-3) if x_dtype == torch.bfloat16 else (1e-5, 1e-4)
        torch.testing.assert_close(got.double(), exact, atol=atol, rtol=rtol)


@needs_avx2_kernels
@pytest.mark.parametrize("k", [128, 600])  # 600: several blocks of k and a partial one
def test_bf16_kernel_gives_a_row_the_same_bits_in_any_batch(k: int) -> None:
    panels = torch.ops.kiln.bf16_pack(weights(64, k, bias=False).weight.bfloat16())
    batch = torch.randn(53, k).bfloat16()  # a block of 48 rows and a partial one
    together = torch.ops.kiln.bf16_linear(batch, panels, 64, None)
    for rows in (2, 3, 4, 6, 7, 37):
        assert torch.equal(
            torch.ops.kiln.bf16_linear(batch[:rows], panels, 64, None), together[:rows]
        )
    for row in (0, 5, 36, 52):
        alone = torch.ops.kiln.bf16_linear(batch[row : row + 1], panels, 64, None)
        assert torch.equal(alone[0], together[row])


@needs_avx2_kernels
def test_bf16_layer_without_onednn_bf16_holds_kilns_panels_once() -> None:
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        pytest.skip("oneDNN runs bf16 on this CPU: the layer uses its packed weight instead")
    w = weights(96, 64, bias=True)
    layer = DenseLinear(w, torch.bfloat16, CPU)
    assert layer.weight is None and layer.packed is None and layer.panels is not None
    assert layer.panels.numel() == 128 * 64  # 96 outputs padded to two panels of 64
    assert layer.weight_bytes() == layer.panels.nbytes + 96 * 2
    x = torch.randn(3, 64).bfloat16()
    expected = F.linear(x.float(), w.weight.bfloat16().float(), w.bias.bfloat16().float())
    torch.testing.assert_close(layer(x).float(), expected, atol=0.1, rtol=0.02)


def test_bf16_kernel_refuses_a_weight_that_does_not_match_the_input() -> None:
    if not native.available():
        pytest.skip("the native kernels do not load here")
    panels = torch.ops.kiln.bf16_pack(torch.zeros(32, 64, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="bf16_pack"):
        torch.ops.kiln.bf16_linear(torch.zeros(2, 48), panels, 32, None)


def test_fallback_layers_multiply_bf16_as_a_float32_sum_rounded_once() -> None:
    # The dequantising layers' bf16 GEMM: in float32 where oneDNN cannot run bf16 (torch's
    # bf16 matmul is a generic loop there), natively elsewhere; the same sum either way.
    x = torch.randn(40, 64).bfloat16()
    weight, bias = torch.randn(24, 64).bfloat16(), torch.randn(24).bfloat16()
    got = float_linear(x, weight, bias)
    assert got.dtype == torch.bfloat16
    expected = F.linear(x.double(), weight.double(), bias.double())
    torch.testing.assert_close(got.double(), expected, atol=1e-3, rtol=2**-8 + 1e-5)
