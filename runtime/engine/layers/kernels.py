"""Quantised linear kernels, and the registry that picks one per layer; weights stay quantised.

`make_linear` picks the layer that runs a `LinearWeights`, from a registry of (predicate,
class) pairs tried in order. Kernels, as measured on a 2-core AVX-512 VNNI CPU (no
AVX512-BF16) with torch 2.13, SmolLM2-135M shapes, one thread:

- W4A16 (`Int4Linear`): `aten._weight_int4pack_mm_for_cpu`. Its fp32 and fp16 paths are
  50-100x slower than its bf16 path, so activations enter as bf16 (still 16-bit activations)
  and scales/zeros are held in bf16. 2x faster than fp32 dense at one token, 1.7x slower at
  32; prefill-sized inputs dequantise instead (see the class). Its AVX2 kernel reads its
  weight far below the memory's speed and its AVX-512 one trails kiln's at a few rows, so
  wherever kiln's native kernels load (AVX2 and FMA) decode-sized inputs run kiln's int4
  kernel instead (runtime/engine/native/csrc/int4_linear.cpp, `int4_on_kiln`): activations as 16-bit
  integers in a power-of-two unit per group, codes multiplied as integers. On a 2-core Zen 3 EPYC,
  one thread, 2.1-3.1x faster per layer than int4pack at one row, 1.3-2.0x at 8-32 rows, a W4A16
  SmolLM2-135M decoding 28.5 -> 16.8 ms per token (`tests/benchmarks/int4_cpu.py`, CPU time). On
  CPUs with AMX, a bf16 model's layers multiply on the tile unit from 6 rows up, prefill included
  (`on_amx_tiles`, `int4_amx_linear`): 3.2-4.4x kiln's int4 kernel at 32 rows.
- W8A16 per-channel (`Int8WeightLinear`): `aten._weight_int8pack_mm`, bf16 activations for
  the same reason; prefill-sized inputs dequantise instead (see the class). On CPUs with AMX,
  W8A16 (per-channel from 4 rows, group-wise at every size) multiplies on the tile unit.
- W8A8 int8 (`Int8Linear`): `torch._int_mm` (VNNI) after per-token dynamic (or static
  per-tensor) symmetric activation quantisation: 4x faster than fp32 dense at 32 tokens.
  Quantising and scaling run as one native pass each (runtime/engine/native/csrc/int8_act.cpp).
  Without VNNI (`INT8_GEMM_FLAGS`) `_int_mm` is a reference loop: on a 2-core Zen 3 EPYC
  (AVX2, no VNNI), 1536x576 at 512 rows 256 ms against float32's 10 ms, so there the codes
  are multiplied by kiln's bf16-weight kernel instead (see the class).
- FP8 (`Fp8Linear`): `torch._scaled_mm` on CUDA. The CPU has no FP8 arithmetic and its
  `_scaled_mm` is slower than converting, so on CPU the weight is dequantised on every call
  and activations are fake-quantised to FP8 (slow: a correctness path, not a fast one).
- W8A16 group-wise (`Int8GroupLinear`, the W8A16 preset's group 128): one
  `_weight_int8pack_mm` per group for decode-sized inputs (0.8 vs 3.6 ms at one token), a
  dequantised GEMM from 9 rows up (a per-group loop loses 2x at 32 tokens: 11 vs 5.6 ms).
- NVFP4 (`Nvfp4Linear`): no FP4 arithmetic here (nor a torch FP4 GEMM on CUDA): the weight
  is dequantised once and activations are fake-quantised per block of 16 (runtime/formats/nvfp4.py),
  the values Blackwell's FP4 GEMM multiplies (a correctness path, not a fast one).
- Anything else integer: the generic `DequantLinear`.

A layer with a pre-quant scale (ModelOpt's AWQ and SmoothQuant exports) runs the kernel its
weights pick behind `PreScaledLinear`, which scales the input first.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F

from kiln.runtime.engine import native
from kiln.runtime.engine.allocator import in_huge_pages
from kiln.runtime.engine.layers.dense import DenseLinear
from kiln.runtime.engine.layers.linear import (
    DequantLinear,
    Linear,
    PreScaledLinear,
    SplitLinear,
    bias_of,
    float_linear,
    onednn_runs_bf16,
)
from kiln.runtime.formats import nvfp4
from kiln.runtime.formats.weights import LinearWeights, concat, dequantize, weights_to

FP8_MAX = 448.0
INT4_GROUP_SIZES = (32, 64, 128, 256)


def on_amx_tiles(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a bf16 model's W4A16 and W8A16 layers multiply on the tile unit from their
    `AMX_ROWS` rows up (runtime/engine/native/csrc/amx_linear.cpp's `int4_amx_linear`,
    `int8_amx_linear`): CPUs where kiln's AMX kernels load. The output is rounded to bf16, so a
    float32 model keeps the other paths."""
    return device.type == "cpu" and dtype == torch.bfloat16 and native.amx_kernels_available()


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
        return group in INT4_GROUP_SIZES and w.in_features % group == 0 and _grouped(w)

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


def int8_tiles(
    w: LinearWeights, scale: torch.Tensor, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """W8A16 codes and their bf16-exact `scale` [N, groups] in int8_amx_linear's layout, with
    the group size, where the tile unit serves this layer (`on_amx_tiles`); else None."""
    group = w.in_features // scale.shape[1]
    if not on_amx_tiles(device, dtype) or group % 32 or w.in_features % group:
        return None
    codes, held = torch.ops.kiln.int8_amx_pack(w.weight.contiguous(), scale.contiguous(), group)
    return codes, held, group


def int8_tiles_linear(
    x: torch.Tensor, tiles: tuple[torch.Tensor, torch.Tensor, int], out_features: int
) -> torch.Tensor:
    codes, held, group = tiles
    return torch.ops.kiln.int8_amx_linear(x, codes, held, out_features, group)


class Int8WeightLinear(Linear):
    """W8A16 per-channel symmetric on `_weight_int8pack_mm` (bf16 activations).

    From `DEQUANT_ROWS` tokens up (prefill) the kernel loses to dequantising the codes and
    running an fp32 GEMM (SmolLM2-135M, 2 threads: the kernel costs ~5 ms per row per forward,
    concurrency-32 TTFT p50 10.2 s). Both paths use the same bf16-rounded activations and
    scales, so they differ only in summation order.

    On CPUs with AMX a bf16 model's layer runs `int8_amx_linear` from `AMX_ROWS` rows up,
    prefill included (`on_amx_tiles`; the weight it multiplies is code times scale rounded to
    bf16): a 2-core Xeon with AMX, one thread, SmolLM2-135M's projections streamed from
    memory, 1.07-1.17x `_weight_int8pack_mm` at 4 rows, 3.7-4.0x at 32, 5.6-5.9x the float32
    dequantised GEMM at 128; below 4 rows `_weight_int8pack_mm` is level or ahead (0.81-0.90x
    at one row), so the layer holds both copies of the codes there (2 bytes a weight).
    """

    DEQUANT_ROWS = 64
    AMX_ROWS = 4  # from here the tile unit (`on_amx_tiles`) beats `_weight_int8pack_mm`

    def __init__(self, w: LinearWeights, dtype: torch.dtype, device: torch.device) -> None:
        assert w.scale is not None
        self.codes = w.weight.contiguous().to(device)
        self.scale = w.scale[:, 0].to(device=device, dtype=torch.bfloat16)
        self.amx = int8_tiles(w, self.scale.float().unsqueeze(1), device, dtype)
        self.bias = bias_of(w, dtype, device)
        self.dtype = dtype
        self.out_features = w.out_features

    @staticmethod
    def supports(w: LinearWeights, device: torch.device) -> bool:
        s = w.scheme
        # The CPU kernel crashes (SIGSEGV) when in_features is not a multiple of 32.
        return (
            s.type == "int"
            and s.num_bits == 8
            and s.activations is None
            and w.scale is not None
            and w.scale.shape[1] == 1
            and w.zero_point is None
            and w.in_features % 32 == 0
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        activations = x.to(torch.bfloat16)
        if self.amx is not None and x.shape[0] >= self.AMX_ROWS:
            y = int8_tiles_linear(activations, self.amx, self.out_features)
        elif x.shape[0] >= self.DEQUANT_ROWS:
            weight = self.codes.float().mul_(self.scale.float().unsqueeze(1))
            y = F.linear(activations.float(), weight).to(self.dtype)
        else:
            y = torch._weight_int8pack_mm(activations, self.codes, self.scale).to(self.dtype)
        return y if self.bias is None else y + self.bias


class Int8GroupLinear(Linear):
    """W8A16 group-wise symmetric (the W8A16 preset's group 128) for decode-sized inputs.

    torch has no group-wise int8 weight kernel, but a group's partial product is exactly a
    per-channel one: x[:, group] @ codes[:, group]^T * scale[:, group]. So the codes are
    split by group at load (same bytes) and each group runs `_weight_int8pack_mm` with its
    own scales; the partial products are summed. Up to `LOOP_MAX_ROWS` rows this beats
    dequantising (0.8 vs 3.6 ms for a 576x3072 layer at one row, one thread); from there the
    layer dequantises (fp32 codes times scales) and runs one GEMM, as `DequantLinear` does.
    A last group narrower than group_size (in_features not a multiple) is handled as is.

    On CPUs with AMX a bf16 model's layer (whole groups) runs `int8_amx_linear` instead, at
    every row count (`on_amx_tiles`): the codes dequantised into bf16 tiles a pair of
    16-column blocks at a time (code times its bf16-held scale) and multiplied on the tile
    unit, the bytes read still one a weight. A 2-core Xeon with AMX, one thread, SmolLM2-135M's
    projections streamed from memory: 1.00-1.18x the per-group loop at one row, 4.2-5.6x at 32
    rows, 3.2-3.8x the dequantised GEMM at 128.
    """

    LOOP_MAX_ROWS = 8

    def __init__(self, w: LinearWeights, dtype: torch.dtype, device: torch.device) -> None:
        assert w.scale is not None and w.scheme.group_size is not None
        size, columns = w.scheme.group_size, w.in_features
        self.bounds = [(a, min(a + size, columns)) for a in range(0, columns, size)]
        # Where the tile unit serves the layer it takes every call (it is ahead from one
        # row), and the codes are held in its layout only; its layout holds whole groups.
        self.amx = None
        if columns % size == 0:
            self.amx = int8_tiles(w, w.scale.to(torch.bfloat16).float(), device, dtype)
        self.codes: list[torch.Tensor] = []
        self.scales: list[torch.Tensor] = []
        self.scale_f32: torch.Tensor | None = None
        if self.amx is None:
            self.codes = [w.weight[:, a:b].contiguous().to(device) for a, b in self.bounds]
            self.scales = [
                w.scale[:, g].to(device=device, dtype=torch.bfloat16).contiguous()
                for g in range(len(self.bounds))
            ]
            self.scale_f32 = w.scale.float().to(device)
        self.bias = bias_of(w, dtype, device)
        self.dtype = dtype
        self.out_features = w.out_features

    @staticmethod
    def supports(w: LinearWeights, device: torch.device) -> bool:
        s = w.scheme
        size = s.group_size
        return (
            device.type == "cpu"
            and s.type == "int"
            and s.num_bits == 8
            and s.activations is None
            and s.strategy == "group"
            and size is not None
            and w.scale is not None
            and w.scale.shape[1] == -(-w.in_features // size)
            and w.zero_point is None
            and w.g_idx is None
            # The CPU kernel crashes (SIGSEGV) unless in_features is a multiple of 32.
            and size % 32 == 0
            and w.in_features % 32 == 0
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.amx is not None:
            y = int8_tiles_linear(x.to(torch.bfloat16), self.amx, self.out_features)
            return y if self.bias is None else y + self.bias
        if x.shape[0] > self.LOOP_MAX_ROWS:
            assert self.scale_f32 is not None
            scale = self.scale_f32
            weight = torch.cat(
                [codes.float().mul_(scale[:, g : g + 1]) for g, codes in enumerate(self.codes)],
                dim=1,
            ).to(self.dtype)
            return float_linear(x, weight, self.bias)
        activations = x.to(torch.bfloat16)
        parts = [
            torch._weight_int8pack_mm(activations[:, a:b].contiguous(), codes, scale)
            for (a, b), codes, scale in zip(self.bounds, self.codes, self.scales, strict=True)
        ]
        # One stacked float32 sum instead of a running add per group (0.53 vs 0.84 ms for
        # a 1536x576 layer at group 64, one row).
        y = torch.stack(parts).sum(0, dtype=torch.float32).to(self.dtype)
        return y if self.bias is None else y + self.bias

    def weight_bytes(self) -> int:
        tiles = [] if self.amx is None else list(self.amx[:2])
        held = [*self.codes, *self.scales, *tiles] + ([] if self.bias is None else [self.bias])
        return sum(t.nbytes for t in held)


# Output dtypes int8_rescale writes (Int8Linear's native path).
NATIVE_INT8_DTYPES = (torch.float32, torch.bfloat16)
# x86 flags under which torch's CPU int8 GEMM (`_int_mm`, through oneDNN) runs VNNI code.
INT8_GEMM_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")


def int8_gemm_native(flags: str | None = None) -> bool:
    """Whether torch's `_int_mm` runs a native int8 kernel on this CPU (`flags`: its
    /proc/cpuinfo flags, read when None); elsewhere it is a reference loop."""
    present = set((native.this_cpus_flags() if flags is None else flags).split())
    return any(f in present for f in INT8_GEMM_FLAGS)


def int8_on_panels(device: torch.device) -> bool:
    """Whether W8A8 codes are multiplied on kiln's bf16 kernel here rather than `_int_mm`:
    an x86 CPU without VNNI where that kernel loads."""
    return device.type == "cpu" and not int8_gemm_native() and native.avx2_kernels_available()


class Int8Linear(Linear):
    """W8A8 int8: symmetric per-channel weights, per-token dynamic or static activations.

    Activation scale = max|x| / 127.5 and codes clamp to [-128, 127], as compressed-tensors
    computes them, so results match its fake quantisation up to float summation order.

    The integer product runs on `torch._int_mm` (int32 accumulation) on CUDA and on CPUs with
    VNNI. On an x86 CPU without VNNI, where kiln's bf16-weight kernel loads, the codes are
    held as bf16 panels instead (every int8 code is exact in bf16; 2 bytes a weight rather
    than 1) and multiplied in float32: each product is exact, and so is each running sum
    while it stays under 2^24 in magnitude (any K up to 1,040 at full-scale codes; beyond,
    only sums of near-full-scale codes round). Measured on a 2-core Zen 3 EPYC (AVX2, no
    VNNI), one thread (`tests/benchmarks/int8_cpu.py`): the layers 4-25x faster than on
    `_int_mm` and 1.1-1.7x float32's time; SmolLM2-135M W8A8 scores a 512-token text in
    4.5 s instead of 56.5 s.

    On the CPU, where the native kernels load, quantising the activations and scaling the
    products are one native pass each (`int8_quantize`, `int8_rescale`,
    runtime/engine/native/csrc/int8_act.cpp) instead of torch's chains of operators, with the same
    bits (tested against this class's torch arithmetic). A 2-core Xeon with AMX, one thread,
    SmolLM2-135M's projections, per-token scales, a bf16 model: the layer 1.2-1.7x faster at one
    row, 1.5-2.2x at 32, 2.7-3.5x at 512 (gate_up at 512 rows: 8.3 -> 2.5 ms, around a 1.8 ms
    `_int_mm`).
    """

    def __init__(self, w: LinearWeights, dtype: torch.dtype, device: torch.device) -> None:
        assert w.scale is not None and w.scheme.activations is not None
        self.panels: torch.Tensor | None = None
        self.codes_t: torch.Tensor | None = None
        if int8_on_panels(device):
            self.panels = torch.ops.kiln.bf16_pack(w.weight.to(torch.bfloat16))
        else:
            self.codes_t = w.weight.to(device).t()
        self.weight_scale = w.scale[:, 0].float().to(device)
        self.act = w.scheme.activations
        self.input_scale = w.input_scale.float().to(device) if w.input_scale is not None else None
        self.bias = bias_of(w, dtype, device)
        self.dtype = dtype
        self.out_features = w.out_features
        # quantising and scaling on int8_act.cpp's native passes (decided once, not per call)
        self.native = device.type == "cpu" and dtype in NATIVE_INT8_DTYPES and native.available()

    @staticmethod
    def supports(w: LinearWeights, device: torch.device) -> bool:
        s, a = w.scheme, w.scheme.activations
        return (
            s.type == "int"
            and s.num_bits == 8
            and w.zero_point is None
            and w.scale is not None
            and w.scale.shape[1] == 1
            and a is not None
            and a.type == "int"
            and a.num_bits == 8
            and a.symmetric
            and (a.dynamic or w.input_scale is not None)
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.native:
            return self._native(x)
        x = x.float()
        if self.act.dynamic:
            dims = -1 if self.act.strategy == "token" else None
            peak = x.abs().amax(dim=-1, keepdim=True) if dims == -1 else x.abs().amax()
            scale = _nonzero(peak / 127.5)
        else:
            assert self.input_scale is not None
            scale = self.input_scale
        codes = torch.round(x / scale).clamp_(-128, 127)
        if self.panels is not None:
            acc = torch.ops.kiln.bf16_linear(codes, self.panels, self.out_features, None)
        else:
            assert self.codes_t is not None
            codes = codes.to(torch.int8)
            rows = codes.shape[0]
            if codes.is_cuda and rows <= 16:  # cuBLASLt's int8 GEMM wants more than 16 rows
                codes = F.pad(codes, (0, 0, 0, 17 - rows))
            acc = torch._int_mm(codes, self.codes_t)[:rows].float()
        y = (acc * (scale * self.weight_scale)).to(self.dtype)
        return y if self.bias is None else y + self.bias

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        """The same arithmetic with quantising and scaling in one native pass each
        (runtime/engine/native/csrc/int8_act.cpp): the same bits."""
        ops = torch.ops.kiln
        fixed = None if self.act.dynamic else self.input_scale
        codes, scale = ops.int8_quantize(x, fixed, self.act.strategy == "token")
        if self.panels is not None:
            acc = ops.bf16_linear(codes.float(), self.panels, self.out_features, None)
        else:
            assert self.codes_t is not None
            acc = torch._int_mm(codes, self.codes_t)
        y = ops.int8_rescale(acc, scale, self.weight_scale, self.dtype)
        return y if self.bias is None else y + self.bias


class Fp8Linear(Linear):
    """FP8 (e4m3) weights with per-tensor or per-channel scales; activations FP8 or 16-bit.

    CUDA: `torch._scaled_mm`. CPU: the weight is dequantised on every call and activations
    are fake-quantised (quantise to FP8 and back), which gives the same values, slowly.
    """

    def __init__(self, w: LinearWeights, dtype: torch.dtype, device: torch.device) -> None:
        assert w.scale is not None
        self.weight = w.weight.to(device)
        self.weight_scale = w.scale.float().to(device)
        self.act = w.scheme.activations
        self.input_scale = w.input_scale.float().to(device) if w.input_scale is not None else None
        self.bias = bias_of(w, dtype, device)
        self.dtype = dtype
        self.device = device
        self.out_features = w.out_features

    @staticmethod
    def supports(w: LinearWeights, device: torch.device) -> bool:
        a = w.scheme.activations
        return (
            w.scheme.type == "float"
            and w.scheme.num_bits == 8
            and w.scale is not None
            and w.scale.shape[1] == 1
            and (a is None or (a.type == "float" and a.num_bits == 8 and a.symmetric))
            and (a is None or a.dynamic or w.input_scale is not None)
        )

    def _scaled_mm(self, x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """FP8 x FP8 on the GPU, accumulated in fp32 by cuBLASLt.

        With row (token) or column (channel) scales cuBLASLt writes bf16 only. An fp32 engine
        therefore multiplies with unit scales, keeps the fp32 product and applies the scales
        itself: one elementwise pass, and its answers match the CPU's fp32 path.
        """
        if self.dtype == torch.float32:
            one = torch.ones((), device=self.device)
            y = torch._scaled_mm(
                x_fp8, self.weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32
            )
            return y * scale * self.weight_scale.t()
        return torch._scaled_mm(
            x_fp8,
            self.weight.t(),
            scale_a=scale.expand(x_fp8.shape[0], 1).contiguous(),
            scale_b=self.weight_scale.t().contiguous(),
            out_dtype=torch.bfloat16,
        ).to(self.dtype)

    def _activation_scale(self, x: torch.Tensor) -> torch.Tensor:
        assert self.act is not None
        if not self.act.dynamic:
            assert self.input_scale is not None
            return self.input_scale.reshape(1, 1)
        if self.act.strategy == "token":
            return _nonzero(x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX)
        return _nonzero(x.abs().amax().float() / FP8_MAX).reshape(1, 1)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is not None:
            scale = self._activation_scale(x)
            x_fp8 = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            if self.device.type == "cuda":
                y = self._scaled_mm(x_fp8, scale)
                return y if self.bias is None else y + self.bias
            x = (x_fp8.to(torch.float32) * scale).to(self.dtype)
        weight = (self.weight.to(torch.float32) * self.weight_scale).to(self.dtype)
        return float_linear(x, weight, self.bias)


class Nvfp4Linear(Linear):
    """NVFP4 weights and activations, emulated: y = fq(x) @ W^T in float32 (see above)."""

    def __init__(self, w: LinearWeights, dtype: torch.dtype, device: torch.device) -> None:
        assert w.input_scale is not None
        self.weight = dequantize(weights_to(w, device), torch.float32)
        self.input_scale = w.input_scale.float().to(device)
        self.bias = bias_of(w, torch.float32, device)
        self.dtype = dtype
        self.out_features = w.out_features

    @staticmethod
    def supports(w: LinearWeights, device: torch.device) -> bool:
        a = w.scheme.activations
        return (
            w.scheme.type == "float"
            and w.scheme.num_bits == 4
            and w.scheme.group_size == nvfp4.BLOCK
            and a is not None
            and a.num_bits == 4
            and w.input_scale is not None
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(nvfp4.fake_quantize(x, self.input_scale), self.weight, self.bias)
        return y.to(self.dtype)


def _grouped(w: LinearWeights) -> bool:
    """True when every group has exactly group_size columns (always so without g_idx)."""
    if w.g_idx is None or w.scale is None:
        return True
    counts = torch.bincount(w.g_idx.long(), minlength=w.scale.shape[1])
    return bool((counts == w.in_features // w.scale.shape[1]).all())


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)


LinearFactory = Callable[[LinearWeights, torch.dtype, torch.device], Linear]
# Tried in order; the first whose predicate holds builds the layer.
LINEAR_KERNELS: list[tuple[Callable[[LinearWeights, torch.device], bool], LinearFactory]] = [
    (lambda w, d: w.scheme.type == "dense", DenseLinear),
    (Int4Linear.supports, Int4Linear),
    (lambda w, d: Int8WeightLinear.supports(w, d) and d.type == "cpu", Int8WeightLinear),
    (Int8GroupLinear.supports, Int8GroupLinear),
    (Int8Linear.supports, Int8Linear),
    (Fp8Linear.supports, Fp8Linear),
    (Nvfp4Linear.supports, Nvfp4Linear),
    (lambda w, d: w.scheme.type == "int" and w.scheme.activations is None, DequantLinear),
]


def make_linear(parts: list[LinearWeights], dtype: torch.dtype, device: torch.device) -> Linear:
    """The fastest exact layer for these projections (stacked when they can be)."""
    stacked = concat(parts) if len(parts) > 1 else parts[0]
    if stacked is None:
        return SplitLinear([make_linear([p], dtype, device) for p in parts])
    if stacked.pre_quant_scale is not None:
        inner = make_linear([replace(stacked, pre_quant_scale=None)], dtype, device)
        return PreScaledLinear(inner, stacked.pre_quant_scale, dtype, device)
    for predicate, factory in LINEAR_KERNELS:
        if predicate(stacked, device):
            return factory(stacked, dtype, device)
    raise ValueError(f"no kernel for weight scheme {stacked.scheme}")
