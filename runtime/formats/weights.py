"""Linear layers: the weight encodings the compiler emits, decoded into one canonical form.

`LinearWeights` is one projection's tensors decoded from disk (signed integer codes, per-row
scales, optional zero points, or FP8 values, and an optional per-input-column pre-quant
scale); `rows`/`columns` slice it, `concat` stacks projections that share an input;
`dequantize` and `effective_weight` are the reference meaning of every encoding. The layers
that run them without dequantising live in kernels.py, the unquantised layer in dense.py;
the ones here are the generic fallback that dequantises on every call (used where no
low-bit kernel fits, see kernels.py) and the wrappers that split or pre-scale a layer's
input.
"""

from __future__ import annotations

import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch


@dataclass(frozen=True, slots=True)
class ActivationScheme:
    """How a layer's input activations are quantised: int or float, per token or tensor."""

    type: str = "int"
    num_bits: int = 8
    strategy: str = "token"
    dynamic: bool = True
    symmetric: bool = True


@dataclass(frozen=True, slots=True)
class WeightScheme:
    """How a layer's weight is stored: dense float, integer codes or FP8, at what granularity."""

    type: str = "dense"
    num_bits: int = 16
    strategy: str = "tensor"
    group_size: int | None = None
    symmetric: bool = True
    activations: ActivationScheme | None = None


@dataclass(slots=True)
class LinearWeights:
    """One projection decoded from disk.

    weight: dense float [N, K], signed int8 codes [N, K], or float8_e4m3fn [N, K].
    scale: float32 [N, groups] (tensor and channel strategies are expanded to [N, 1]).
    zero_point: int8 [N, groups] or None; g_idx: int [K] group of each input column or None.
    input_scale: float32 () static activation scale, or None.
    pre_quant_scale: float32 [K] multiplying the input before the layer (AWQ, SmoothQuant
    checkpoints that keep it separate), or None: y = (x * pre_quant_scale) @ W^T.
    """

    scheme: WeightScheme
    weight: torch.Tensor
    scale: torch.Tensor | None = None
    zero_point: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    pre_quant_scale: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])

    def rows(self, index: torch.Tensor | slice) -> LinearWeights:
        """The output channels `index` (a tensor-parallel or per-head slice, or a block)."""

        def pick(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t[index]

        return replace(
            self,
            weight=self.weight[index],
            scale=pick(self.scale),
            zero_point=pick(self.zero_point),
            bias=pick(self.bias),
        )

    def columns(self, start: int, end: int) -> LinearWeights:
        """The input channels start:end; raises ValueError where that cuts a scale group."""
        if self.g_idx is not None:
            raise ValueError("act-order (g_idx) weights cannot be split by input channel")
        scale, zero = self.scale, self.zero_point
        if scale is not None and self.scheme.strategy == "group":
            group = self.scheme.group_size or self.in_features // scale.shape[1]
            if start % group or (end % group and end != self.in_features):
                raise ValueError(
                    f"input channels {start}:{end} cut a quantisation group of {group}"
                )
            first, last = start // group, -(-end // group)
            scale = scale[:, first:last]
            zero = None if zero is None else zero[:, first:last]
        pqs = self.pre_quant_scale
        return replace(
            self,
            weight=self.weight[:, start:end],
            scale=scale,
            zero_point=zero,
            pre_quant_scale=None if pqs is None else pqs[start:end],
        )


def row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A stored weight scale (per tensor, per row, or per row and group) as float32
    [rows, groups], the `LinearWeights` convention."""
    scale = scale.to(torch.float32)
    scale = scale.reshape(rows, -1) if scale.numel() >= rows else scale.reshape(1, 1)
    return scale.expand(rows, -1).contiguous()


def concat(parts: list[LinearWeights]) -> LinearWeights | None:
    """Stack projections that share an input (q/k/v, gate/up) into one, when exact."""
    first = parts[0]
    same = all(
        p.scheme == first.scheme
        and p.g_idx is None
        and (p.scale is None) == (first.scale is None)
        and (p.zero_point is None) == (first.zero_point is None)
        and _same_optional(p.input_scale, first.input_scale)
        and _same_optional(p.pre_quant_scale, first.pre_quant_scale)
        for p in parts
    )
    if not same:
        return None
    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.cat(
            [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
        )
    return replace(
        first,
        weight=torch.cat([p.weight for p in parts]),
        scale=_cat_optional([p.scale for p in parts]),
        zero_point=_cat_optional([p.zero_point for p in parts]),
        bias=bias,
    )


def _cat_optional(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = [t for t in tensors if t is not None]
    return torch.cat(present) if present else None


def _same_optional(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(torch.equal(a, b))


def as_float32(t: torch.Tensor) -> torch.Tensor:
    """`t` in float32; FP8 codes through a 256-entry table on the CPU, which is exact and ~3×
    faster than torch's element-wise conversion there (it dominates dequantising FP8)."""
    return fp8_as(t, torch.float32)


def fp8_as(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` in `dtype`; on the CPU, FP8 codes into float32, bfloat16 or float16 through a
    table of that dtype's bits (exact: it holds every e4m3 value), two codes at a time (a
    65,536-entry table of pairs: 0.89 against 1.40 ns a code into float32 on one Xeon core), a
    large tensor in pieces on every core (numpy's lookup runs on one, without the GIL)."""
    table = _FP8_TABLES.get(dtype)
    if t.dtype != torch.float8_e4m3fn or t.device.type != "cpu" or table is None:
        return t.to(dtype)
    import numpy as np

    codes = t.contiguous().view(torch.uint8).reshape(-1).numpy()
    out = np.empty(codes.shape, table.dtype)
    pieces = range(0, len(codes), _TABLE_PIECE)  # even starts: pairs never straddle pieces
    pairs = _fp8_pair_table(dtype) if sys.byteorder == "little" else None

    def one(start: int) -> None:
        end = min(start + _TABLE_PIECE, len(codes))
        look_up(table, pairs, codes[start:end], out[start:end])

    if len(pieces) > 1 and torch.get_num_threads() > 1:
        for _ in _table_pool().map(one, pieces):
            pass
    else:
        for start in pieces:
            one(start)
    return torch.from_numpy(out).view(dtype).view(t.shape)


# Codes looked up at a time where a tensor is split over cores (the report's activations: a
# [tokens, 5632] input is ~6M codes).
_TABLE_PIECE = 1 << 19
_TABLE_POOL: list[ThreadPoolExecutor] = []
os.register_at_fork(after_in_child=_TABLE_POOL.clear)  # a forked child has none of the threads


def _table_pool() -> ThreadPoolExecutor:
    if not _TABLE_POOL:
        _TABLE_POOL.append(ThreadPoolExecutor(torch.get_num_threads(), "kiln-fp8-table"))
    return _TABLE_POOL[0]


_FP8_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
_FP8_PAIR_TABLES: dict[torch.dtype, Any] = {}


def _fp8_pair_table(dtype: torch.dtype) -> Any:
    pairs = _FP8_PAIR_TABLES.get(dtype)
    if pairs is None:
        pairs = _FP8_PAIR_TABLES[dtype] = pair_table(_FP8_TABLES[dtype])
    return pairs


def pair_table(single: Any) -> Any:
    """A 256-entry numpy table as one of 65,536 pairs: two codes (a little-endian uint16, the
    first code in its low byte) → their two entries' bits side by side, the first in the low
    half (how they lie in memory)."""
    import numpy as np

    size = single.itemsize
    wide = {1: np.uint16, 2: np.uint32, 4: np.uint64}[size]
    bits = single.view({1: np.uint8, 2: np.uint16, 4: np.uint32}[size]).astype(wide)
    both = np.arange(1 << 16)
    return bits[both & 0xFF] | (bits[both >> 8] << wide(8 * size))


def look_up(single: Any, pairs: Any | None, codes: Any, out: Any) -> None:
    """out[i] = single[codes[i]] for uint8 `codes` (numpy arrays): two codes at a time through
    `pairs` (`pair_table(single)`, little-endian machines), an odd count's last code through
    `single`. Without numpy's bounds check (mode "clip"): a uint8 or uint16 index is always
    within its table, and the check cost as much as the lookup (FP8 into float32: 2.5 → 1.2 ns
    a code on one Xeon core)."""
    import numpy as np

    even = len(codes) - len(codes) % 2 if pairs is not None else 0
    if pairs is not None and even:
        np.take(pairs, codes[:even].view(np.uint16), out=out[:even].view(pairs.dtype), mode="clip")
    if even < len(codes):
        np.take(single, codes[even:], out=out[even:], mode="clip")


_FP8_TABLES = {
    torch.float32: _FP8_VALUES.to(torch.float32).numpy(),
    torch.bfloat16: _FP8_VALUES.to(torch.bfloat16).view(torch.int16).numpy(),
    torch.float16: _FP8_VALUES.to(torch.float16).view(torch.int16).numpy(),
}


def dequantize(w: LinearWeights, dtype: torch.dtype) -> torch.Tensor:
    """The float weight [N, K] an encoding stores: (code - zero) * scale (the input's
    pre-quant scale, if any, is not folded in: see `effective_weight`)."""
    if w.scale is None:
        return w.weight.to(dtype)
    codes = as_float32(w.weight)
    scale = w.scale.to(torch.float32)
    zero = None if w.zero_point is None else w.zero_point.to(torch.float32)
    groups = scale.shape[1]
    size = w.scheme.group_size or w.in_features // groups
    if w.g_idx is None and groups * size == w.in_features:
        # Contiguous groups of one size: broadcast each group's scale over its columns
        # rather than gathering a scale per column (the same products, in a fraction of the
        # time and memory).
        grouped = codes.view(codes.shape[0], groups, size)
        if zero is not None:
            grouped = grouped - zero[:, :, None]
        return (grouped * scale[:, :, None]).view(codes.shape).to(dtype)
    if w.g_idx is not None:
        index = w.g_idx.long()
    else:
        # compressed-tensors rounds the group count up: when in_features is not a multiple of
        # group_size (SmolLM2's 576 at group 128) the last group is narrower.
        index = torch.arange(w.in_features, device=codes.device) // size
    if zero is not None:
        codes = codes - zero[:, index]
    return (codes * scale[:, index]).to(dtype)


def effective_weight(w: LinearWeights, dtype: torch.dtype) -> torch.Tensor:
    """The float weight [N, K] the layer computes with: dequantised, pre-quant scale folded
    into its input columns (y = x @ W^T)."""
    weight = dequantize(w, torch.float32)
    if w.pre_quant_scale is not None:
        weight = weight * w.pre_quant_scale.to(torch.float32)[None, :]
    return weight.to(dtype)


def weights_to(w: LinearWeights, device: torch.device) -> LinearWeights:
    """The same encoding with every tensor on `device`."""

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return replace(
        w,
        weight=w.weight.to(device),
        scale=move(w.scale),
        zero_point=move(w.zero_point),
        g_idx=move(w.g_idx),
        input_scale=move(w.input_scale),
        bias=move(w.bias),
        pre_quant_scale=move(w.pre_quant_scale),
    )
