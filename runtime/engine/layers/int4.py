"""W4A16: int4 weight codes in groups, 16-bit activations (`Int4Linear`); kernels.py says
which kernel runs at which row count and why."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.runtime.engine import native
from kiln.runtime.engine.allocator import in_huge_pages
from kiln.runtime.engine.layers.linear import (
    Linear,
    bias_of,
    onednn_runs_bf16,
)
from kiln.runtime.engine.layers.shared import on_amx_tiles, whole_groups
from kiln.runtime.formats.weights import LinearWeights

INT4_GROUP_SIZES = (32, 64, 128, 256)


def _unpack_int4_amx(codes: torch.Tensor, rows: int) -> torch.Tensor:
    """The unsigned codes [rows, K] (uint8, 0-15) `int4_amx_pack` stored as
    [pairs, chunks, 2, 16, 16] (byte 2c + t of a tile row: column c at k = 2j + t in its low
    nibble, column c + 8 in its high one)."""
    pairs, chunks = codes.shape[0], codes.shape[1]
    halves = torch.stack((codes & 15, codes >> 4), dim=-1)  # [..., 16 (2c + t), 2 (half)]
    ordered = halves.view(pairs, chunks, 2, 16, 8, 2, 2)  # pair chunk block j c t half
    return ordered.permute(0, 2, 6, 4, 1, 3, 5).reshape(pairs * 32, chunks * 32)[:rows]


def int4_on_kiln(device: torch.device) -> bool:
    """Whether W4A16 decode runs on kiln's int4 kernel here rather than torch's int4pack:
    on every CPU where kiln's AVX2 kernels load. torch's AVX2 int4 kernel is the slow one
    (see Int4Linear); its AVX-512 one also trails kiln's at one row (one thread, a Xeon with
    AVX512-BF16 and AMX, SmolLM2-135M's projections: 1.26-1.61x per layer, 1.38x summed over
    a step's) and is level with it from 2 to 32 rows (0.89-1.30x per layer, 0.95-1.09x
    summed), `tests/benchmarks/int4_cpu.py`."""
    return device.type == "cpu" and native.avx2_kernels_available()


class Int4Linear(Linear):
    """W4A16, group-wise or per-channel, with or without zero points, on the int4pack kernel.

    The kernel computes w = (u - 8) * scale + zero with u in [0, 15]; our codes q = u - 8 give
    w = (q - zp) * scale, so zero = -zp * scale. Act-order (g_idx) weights are permuted once so
    their groups are contiguous, and each input is permuted to match.

    From `DEQUANT_ROWS` tokens up (prefill), the kernel loses to dequantising the nibbles
    (kept as well: 0.5 byte per weight) and running a float GEMM. Measured for a 576x3072
    layer, one thread: kernel 16 / 64 ms at 128 / 512 tokens, dequantise (~12 ms) + GEMM
    15 / 35 ms (an AVX-512 VNNI CPU without bf16). Where the native kernels load, the
    nibbles are dequantised in one pass (runtime/engine/native/csrc/int4_dequant.cpp), and a bf16
    model then runs the GEMM in bf16 on a bf16-rounded weight: 3072x576 at 128 rows, one thread, a
    Xeon with AMX, 6.1 ms (torch dequantise 2.3 ms + float32 GEMM) vs ~1.5 ms. Both paths use the
    same bf16-rounded activations, scales and zeros; they differ in summation order and, for bf16
    models' prefill where oneDNN runs bf16, the weight's bf16 rounding (on other CPUs a bf16 model's
    prefill takes the float32 GEMM: torch's bf16 matmul there is a generic loop).

    Where kiln's native kernels load (`int4_on_kiln`: AVX2 and FMA) decode-sized inputs run
    kiln's int4 kernel in place of int4pack, on the same bf16 activations, scales and zeros:
    each group's activations as 16-bit integers in a power-of-two unit set by the group's
    largest (values within 2^7 of it exact, smaller ones rounded to 2^-15 of it), integer
    products, float32 per group, one rounding to the model's dtype (int4pack rounds its
    output to bf16 first).

    On CPUs with AMX a bf16 model's layer runs `int4_amx_linear` from `AMX_ROWS` rows up,
    prefill included (`on_amx_tiles`): each pair of 16-column blocks dequantised into bf16
    tiles in a per-thread buffer (the weight int4_dequant computes) and multiplied on the tile
    unit, so the codes are read at half a byte a weight and the arithmetic is amx_linear's.
    Measured on a 2-core Xeon with AMX, one thread, SmolLM2-135M's projections streamed from
    memory (`tests/benchmarks/int4_cpu.py`): against kiln's int4 kernel 1.02-1.29x at 6 rows,
    3.2-4.4x at 32, 2.1-3.8x at 128 (against dequantise + oneDNN); 32 greedy streams of the
    demo's W4A16 artifact decode in 49.7 instead of 98.5 ms a step. Below 6 rows the int4
    kernel is level or ahead (0.85-1.17x at 5). The layer then holds the codes in the tile
    layout instead of as nibbles (`dequantized` reads them back), so it still holds two
    copies: the int4 kernel's and the tiles'. A sequence's rows can take either path
    depending on how many rows the step has (as at DEQUANT_ROWS): the two differ in
    summation order and in the tile path's bf16-rounded weight, within bf16 rounding.
    """

    DEQUANT_ROWS = 128
    AMX_ROWS = 6  # from here the tile unit (`on_amx_tiles`) beats kiln's int4 kernel

    def __init__(self, w: LinearWeights, dtype: torch.dtype, device: torch.device) -> None:
        assert w.scale is not None
        codes, scale, zero_point = w.weight, w.scale.float(), w.zero_point
        self.group_size = w.in_features // scale.shape[1]
        self.perm: torch.Tensor | None = None
        if w.g_idx is not None:
            self.perm = torch.argsort(w.g_idx.long(), stable=True).to(device)
            codes = codes[:, self.perm.cpu()]
        unsigned = (codes.to(torch.int32) + 8).contiguous()
        zeros = -zero_point.float() * scale if zero_point is not None else torch.zeros_like(scale)
        self.scales_and_zeros: torch.Tensor | None = (
            torch.stack([scale.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous().to(device)
        )
        rows = w.out_features
        # [rows, groups, 1] for broadcasting over each group's columns in the dequant path.
        held = self.scales_and_zeros
        self.scale_rows = held[..., 0].t().float().reshape(rows, -1, 1)
        self.zero_rows = held[..., 1].t().float().reshape(rows, -1, 1)
        # From AMX_ROWS rows up on the tile unit, prefill included; the codes are held in its
        # layout instead of as nibbles (dequantized() reads them back).
        self.amx: tuple[torch.Tensor, torch.Tensor] | None = None
        self.nibbles: torch.Tensor | None = None
        if on_amx_tiles(device, dtype):
            self.amx = torch.ops.kiln.int4_amx_pack(
                unsigned.to(torch.uint8),
                self.scale_rows[..., 0].contiguous(),
                self.zero_rows[..., 0].contiguous(),
                self.group_size,
            )
        else:
            nibbles = unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)
            self.nibbles = nibbles.to(torch.uint8).to(device)
        # Decode-sized inputs: kiln's kernel (codes in its panels, bf16 scales and zeros
        # beside them) where it serves this CPU, else torch's int4pack kernel.
        self.kiln_sz: torch.Tensor | None = None
        if int4_on_kiln(device):
            packed, self.kiln_sz = torch.ops.kiln.int4_pack(
                unsigned.to(torch.uint8), self.scale_rows[..., 0], self.zero_rows[..., 0]
            )
            self.packed = in_huge_pages(packed)  # what a decode step streams
            self.scales_and_zeros = None  # int4pack's layout, which nothing reads here
        else:
            self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(unsigned, 2).to(device)
        self.bias = bias_of(w, dtype, device)
        self.dtype = dtype
        self.out_features = w.out_features

    @staticmethod
    def supports(w: LinearWeights, device: torch.device) -> bool:
        if w.scheme.type != "int" or w.scheme.num_bits != 4 or w.scheme.activations is not None:
            return False
        if device.type != "cpu" or w.scale is None or w.out_features % 16:
            return False
        group = w.in_features // w.scale.shape[1]
        return group in INT4_GROUP_SIZES and w.in_features % group == 0 and whole_groups(w)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] the kernel computes with (columns in kernel order), computed in
        float32 and stored as `dtype` (float32 or bfloat16)."""
        nibbles = self.nibbles
        if nibbles is None:
            assert self.amx is not None
            unsigned = _unpack_int4_amx(self.amx[0], self.scale_rows.shape[0])
            nibbles = unsigned[:, 0::2] | (unsigned[:, 1::2] << 4)
        if nibbles.device.type == "cpu" and native.available():
            rows = self.scale_rows.shape[0]
            return torch.ops.kiln.int4_dequant(
                nibbles,
                self.scale_rows.reshape(rows, -1).contiguous(),
                self.zero_rows.reshape(rows, -1).contiguous(),
                self.group_size,
                dtype,
            )
        low, high = nibbles & 15, nibbles >> 4
        unsigned = torch.stack((low, high), dim=-1).view(nibbles.shape[0], -1)
        grouped = unsigned.float().sub_(8).view(self.scale_rows.shape[0], -1, self.group_size)
        return grouped.mul_(self.scale_rows).add_(self.zero_rows).view(unsigned.shape).to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        # (a dtype test, not a no-op .to(): ~120 calls a decode step)
        activations = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        rows = x.shape[0]
        if self.amx is not None and rows >= self.AMX_ROWS:
            codes, held = self.amx
            y = torch.ops.kiln.int4_amx_linear(
                activations, codes, held, self.out_features, self.group_size
            )
        elif rows >= self.DEQUANT_ROWS and self.dtype == torch.bfloat16 and onednn_runs_bf16():
            y = F.linear(activations, self.dequantized(torch.bfloat16))
        elif rows >= self.DEQUANT_ROWS:
            y = F.linear(activations.float(), self.dequantized()).to(self.dtype)
        elif self.kiln_sz is not None:
            y = torch.ops.kiln.int4_linear(
                activations, self.packed, self.kiln_sz, self.out_features, self.dtype
            )
        else:
            assert self.scales_and_zeros is not None
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                activations, self.packed, self.group_size, self.scales_and_zeros
            ).to(self.dtype)
        return y if self.bias is None else y + self.bias

    def weight_bytes(self) -> int:
        # what the decode kernel reads (one of the two scale layouts), not the prefill nibbles
        held = (self.packed, self.scales_and_zeros, self.kiln_sz, self.bias)
        return sum(t.nbytes for t in held if t is not None)
