"""int8 weights: W8A16 per channel (`Int8WeightLinear`) and group-wise (`Int8GroupLinear`),
and W8A8 with quantised activations (`Int8Linear`); kernels.py says which kernel runs where."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.runtime.engine import native
from kiln.runtime.engine.layers.linear import (
    Linear,
    bias_of,
    float_linear,
)
from kiln.runtime.engine.layers.shared import nonzero, on_amx_tiles
from kiln.runtime.formats.weights import LinearWeights


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
            scale = nonzero(peak / 127.5)
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


# Output dtypes int8_rescale writes (Int8Linear's native path).
NATIVE_INT8_DTYPES = (torch.float32, torch.bfloat16)


# x86 flags under which torch's CPU int8 GEMM (`_int_mm`, through oneDNN) runs VNNI code.
INT8_GEMM_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
