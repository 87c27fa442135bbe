"""The fused elementwise kernels (runtime/engine/native/csrc/elementwise.cpp) against the torch
operators they replace: the same values, in float32 and bfloat16, for widths that end mid-vector."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from kiln.runtime.engine import native

pytestmark = pytest.mark.skipif(
    native.missing_toolchain() is not None or os.environ.get("KILN_NATIVE") == "0",
    reason=f"native kernels cannot be built here: {native.missing_toolchain()}",
)

DTYPES = [torch.float32, torch.bfloat16]
WIDTHS = [576, 64, 37]  # SmolLM2's hidden size, one vector's worth, and a ragged tail


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    # bf16: torch's mean and ours sum in different orders; a rounding boundary moves one ulp.
    return {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0.02, "rtol": 0.01}


@pytest.fixture(autouse=True, scope="module")
def built() -> None:
    assert native.available()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
@pytest.mark.parametrize("rows", [1, 33])
def test_rms_norm_matches_torch(dtype: torch.dtype, width: int, rows: int) -> None:
    generator = torch.Generator().manual_seed(width + rows)
    x = torch.randn(rows, width, generator=generator).to(dtype)
    weight = (torch.rand(width, generator=generator) + 0.5).to(dtype)
    got = torch.ops.kiln.rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype
    torch.testing.assert_close(got, F.rms_norm(x, (width,), weight, 1e-5), **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_add_rms_norm_adds_in_place_then_normalises(dtype: torch.dtype, width: int) -> None:
    generator = torch.Generator().manual_seed(width)
    residual = torch.randn(5, width, generator=generator).to(dtype)
    delta = torch.randn(5, width, generator=generator).to(dtype)
    weight = (torch.rand(width, generator=generator) + 0.5).to(dtype)
    total = residual + delta
    got = torch.ops.kiln.add_rms_norm_(residual, delta, weight, 1e-6)
    assert torch.equal(residual, total)  # the add rounds exactly as torch's
    torch.testing.assert_close(got, F.rms_norm(total, (width,), weight, 1e-6), **tolerance(dtype))


def test_a_subnormal_bf16_sum_is_kept_or_flushed_where_the_build_converts_natively() -> None:
    # kiln's AVX-512 rows round to bf16 with the CPU's conversion where it has AVX512-BF16,
    # which flushes subnormals (|x| < 1.2e-38) that torch keeps; elsewhere they round as torch
    residual = torch.full((2, 40), 1e-39).bfloat16()
    delta = torch.full((2, 40), 1e-39).bfloat16()
    total = residual + delta
    torch.ops.kiln.add_rms_norm_(residual, delta, torch.ones(40).bfloat16(), 1e-6)
    if torch.ops.kiln.bf16_flushes_subnormals():
        assert "avx512_bf16" in native.this_cpus_flags().split()
        assert torch.equal(residual, torch.zeros_like(total))
    else:
        assert torch.equal(residual, total)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_silu_mul_matches_silu_times_up(dtype: torch.dtype, width: int) -> None:
    generator = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(7, 2 * width, generator=generator) * 4).to(dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])  # exp's clamped ends and zero
    gate_up[1, 1] = gate_up[2, width - 1] = float("nan")  # in a vector and in the tail
    expected = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    got = torch.ops.kiln.silu_mul(gate_up)
    assert got.shape == (7, width) and got.dtype == dtype
    torch.testing.assert_close(
        got, expected, atol=1e-5, rtol=1e-5 if dtype == torch.float32 else 0.01, equal_nan=True
    )


def test_kernels_refuse_what_they_cannot_read() -> None:
    with pytest.raises(RuntimeError, match="weight \\[H\\]"):
        torch.ops.kiln.rms_norm(torch.zeros(2, 8), torch.ones(4), 1e-5)
    with pytest.raises(RuntimeError, match="same dtype"):
        torch.ops.kiln.rms_norm(torch.zeros(2, 8), torch.ones(8).bfloat16(), 1e-5)
    with pytest.raises(RuntimeError, match="gate and up"):
        torch.ops.kiln.silu_mul(torch.zeros(2, 7))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [16, 64, 40])  # half a vector, two full ones, one and a tail
def test_rope_rotates_query_and_key_heads_in_place(dtype: torch.dtype, dim: int) -> None:
    heads, kv_heads, positions_held = 4, 2, 40
    generator = torch.Generator().manual_seed(3)
    qkv = torch.randn(6, (heads + 2 * kv_heads) * dim, generator=generator).to(dtype)
    angles = torch.outer(torch.arange(positions_held).float(), torch.rand(dim // 2))
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(dtype)
    positions = torch.tensor([0, 5, 39, 7, 7, 1])
    rotated = (heads + kv_heads) * dim
    x = qkv[:, :rotated].unflatten(-1, (heads + kv_heads, dim))
    swapped = torch.cat((x[..., dim // 2 :], x[..., : dim // 2]), -1)
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    expected = torch.addcmul(x * c, swapped, s).flatten(1)
    values = qkv[:, rotated:].clone()
    torch.ops.kiln.rope_(qkv, positions, cos, sin, heads + kv_heads, dim)
    torch.testing.assert_close(qkv[:, :rotated], expected, **tolerance(dtype))
    assert torch.equal(qkv[:, rotated:], values)  # the value heads are not rotated


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("dim", "rotary"), [(32, 24), (128, 96), (40, 2)])
def test_rope_with_narrower_tables_rotates_the_first_channels_of_each_head(
    dtype: torch.dtype, dim: int, rotary: int
) -> None:
    """Partial rotary (Phi-4-mini's 96 of 128): tables as wide as the rotated channels turn
    those of each head as transformers' Phi-3 does and leave the rest of the head as it was."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb

    heads, kv_heads = 3, 1
    width = (heads + kv_heads) * dim  # the query and key heads; the value heads follow
    generator = torch.Generator().manual_seed(dim + rotary)
    qkv = torch.randn(5, width + kv_heads * dim, generator=generator).to(dtype)
    angles = torch.outer(torch.arange(20).float(), torch.rand(rotary // 2, generator=generator))
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)
    positions = torch.tensor([0, 19, 3, 3, 11])
    before = qkv.clone()
    x = before[:, :width].unflatten(-1, (heads + kv_heads, dim)).transpose(0, 1)
    q, k = apply_rotary_pos_emb(x[:heads], x[heads:], cos[positions], sin[positions], 0)
    folded = torch.cat((-sin[:, : rotary // 2], sin[:, rotary // 2 :]), -1)  # kiln's sign
    torch.ops.kiln.rope_(qkv, positions, cos, folded.contiguous(), heads + kv_heads, dim)
    got = qkv[:, :width].unflatten(-1, (heads + kv_heads, dim)).transpose(0, 1)
    torch.testing.assert_close(got, torch.cat((q, k)), **tolerance(dtype))
    assert torch.equal(got[..., rotary:], x[..., rotary:])  # the unrotated channels
    assert torch.equal(qkv[:, width:], before[:, width:])  # the value heads


def test_rope_refuses_tables_wider_than_a_head() -> None:
    table = torch.zeros(4, 16)
    with pytest.raises(RuntimeError, match="rotary dim even and at most dim"):
        torch.ops.kiln.rope_(torch.zeros(1, 16), torch.tensor([0]), table, table, 2, 8)


def test_rope_refuses_a_position_past_its_tables() -> None:
    table = torch.zeros(4, 8)
    with pytest.raises(RuntimeError, match="past the tables"):
        torch.ops.kiln.rope_(torch.zeros(1, 16), torch.tensor([4]), table, table, 2, 8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [49152, 64, 37, 1])
def test_argmax_rows_is_torchs_first_maximum(dtype: torch.dtype, width: int) -> None:
    generator = torch.Generator().manual_seed(width)
    x = torch.randn(5, width, generator=generator).to(dtype)
    if width > 30:
        x[0, 3] = x[0, width - 2] = 50  # an exact tie: the first
        x[1, 29] = float("nan")  # a NaN wins, the first of them
        x[1, width - 1] = float("nan")
        x[1, 0] = float("inf")
        x[3] = 0.0
        x[3, 5] = -0.0  # zeros of either sign are equal: the first
    x[2] = float("-inf")
    x[4] = x[4].round()  # many ties
    expected = x.max(dim=-1).indices
    assert torch.equal(torch.ops.kiln.argmax_rows(x), expected)
    assert torch.equal(torch.ops.kiln.argmax_rows(x.t().contiguous().t()), expected)


def test_argmax_rows_refuses_what_it_cannot_read() -> None:
    with pytest.raises(RuntimeError, match="logits \\[M, N > 0\\]"):
        torch.ops.kiln.argmax_rows(torch.zeros(2, 0))
    with pytest.raises(RuntimeError, match="float32 or bfloat16"):
        torch.ops.kiln.argmax_rows(torch.zeros(2, 3, dtype=torch.float64))
