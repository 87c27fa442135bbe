"""One linear laid out for a TensorRT-LLM rank: q/k/v fused into one GEMM, sharded for
tensor parallelism, padded to the shapes TensorRT-LLM's group-wise layer creates, and int4
codes packed as ModelOpt packs them. The rules (which role splits how, which features pad to
what) are in compiler/trtllm/export/layouts.py's docstring and
compiler/trtllm/rules/exclusions.py; the checkpoint tensors they become are named in layouts.py.
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch

from kiln.compiler.trtllm.rules.exclusions import GROUPWISE, padded_features
from kiln.runtime.base.errors import UsageError
from kiln.runtime.formats.weights import (
    LinearWeights,
    as_float32,
    dequantize,
    look_up,
    pair_table,
)


def requantize(codes: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """`codes` re-expressed at a scale 1/`ratio` times theirs, rounded to the nearest code
    (float8 rounds in the cast; integer codes are rounded, then clamped to their range)."""
    return _rounded(as_float32(codes) * ratio, codes.dtype)


def _rounded(scaled: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 values as codes of `dtype`: float8 rounds in the cast; integers are rounded,
    then clamped to their range."""
    if dtype.is_floating_point:
        return scaled.to(dtype)
    info = torch.iinfo(dtype)
    return scaled.round().clamp(info.min, info.max).to(dtype)


# float32 rows re-expressed at once: a block stays within a core's cache through its passes,
# where whole weights in float32 went through memory once per pass.
ROW_BLOCK_BYTES = 1 << 20
# Codes from which a one-byte weight at one scale is re-expressed through a table of its 256
# codes rather than a block of rows at a time.
BY_CODE_MIN = 1 << 16


def at_scale(p: LinearWeights, scale: torch.Tensor) -> tuple[torch.Tensor, float]:
    """`p`'s codes (per-tensor scaled) re-expressed at `scale`, and the largest change that
    made relative to `p`'s largest weight: the codes and the figure of doing it to the whole
    weight (maxima are exact in any order). A one-byte weight at one scale is re-expressed
    through the table of what that does to each of its 256 codes (`_by_code`); any other a
    block of rows at a time."""
    assert p.scale is not None
    found = _by_code(p, scale)
    if found is not None:
        return found
    out = torch.empty_like(p.weight)
    step = max(1, ROW_BLOCK_BYTES // (4 * max(p.in_features, 1)))
    largest = changed = torch.zeros((), dtype=torch.float32)
    for start in range(0, p.out_features, step):
        requant, change, size = _moved(p.rows(slice(start, start + step)), scale)
        out[start : start + len(requant)] = requant
        changed = torch.maximum(changed, change.max())
        largest = torch.maximum(largest, size.max())
    return out, _relative(changed, largest)


def _moved(
    block: LinearWeights, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`block`'s codes at `scale`, with each weight's change |after - before| and its size
    |before| in float32."""
    assert block.scale is not None
    if block.zero_point is None:  # the codes decoded once, for the new codes and the old
        codes = as_float32(block.weight)
        requant = _rounded(codes * (block.scale / scale), block.weight.dtype)
        before = codes.mul_(block.scale)  # what dequantize gives, value for value
    else:
        requant = requantize(block.weight, block.scale / scale)
        before = dequantize(block, torch.float32)
    after = as_float32(requant).mul_(scale)
    return requant, after.sub_(before).abs_(), before.abs_()


def _relative(changed: torch.Tensor, largest: torch.Tensor) -> float:
    return float(changed / largest.clamp_min(torch.finfo(torch.float32).tiny))


def _by_code(p: LinearWeights, scale: torch.Tensor) -> tuple[torch.Tensor, float] | None:
    """`at_scale` of a one-byte weight (FP8, int8) whose rows share one scale and no zero
    point, through the table of its 256 codes: each code's new code, change and size are what
    `_moved` gives that code (a row of all 256 codes at `p`'s scale goes through it), so the
    new codes are a lookup (`look_up`) and the figure is the largest change and size
    among the codes present. Same codes and figure as the blocks (tested for every code), for
    a third of the CPU: an [8192, 3072] FP8 weight 2.3 against 7.8 ns a weight on a 2-core
    Xeon. None where it does not apply."""
    import numpy as np

    weight, row_scale = p.weight, p.scale
    assert row_scale is not None
    if (
        weight.element_size() != 1
        or weight.device.type != "cpu"
        or weight.numel() < BY_CODE_MIN
        or p.zero_point is not None
        or row_scale.dim() != 2
        or row_scale.shape[1] != 1
        or not bool((row_scale == row_scale[0, 0]).all())  # NaN scales: through the blocks
    ):
        return None
    every = torch.arange(256, dtype=torch.uint8).view(weight.dtype).view(1, 256)
    table, change, size = _moved(replace(p.rows(slice(0, 1)), weight=every), scale)
    codes = weight.contiguous().view(torch.uint8).reshape(-1)
    present = torch.bincount(codes, minlength=256) > 0
    lut = table.view(torch.uint8).reshape(-1).numpy()
    flat = codes.numpy()
    out = np.empty_like(flat)
    look_up(lut, pair_table(lut) if sys.byteorder == "little" else None, flat, out)
    new = torch.from_numpy(out).view(weight.dtype).view(weight.shape)
    return new, _relative(change.reshape(-1)[present].max(), size.reshape(-1)[present].max())


def fuse_linears(
    parts: list[LinearWeights], algo: str, notes: list[str], name: str
) -> LinearWeights:
    """Stack linears that share an input along the output dim (q, k, v → qkv)."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    weight, bias = torch.cat([p.weight for p in parts]), _cat([p.bias for p in parts])
    if first.scale is None:  # float
        return replace(first, weight=weight, bias=bias)
    input_scale = None
    if first.input_scale is not None:
        input_scale = torch.stack([p.input_scale for p in parts if p.input_scale is not None])
        input_scale = input_scale.max()
    pqs = first.pre_quant_scale
    if pqs is not None and any(
        p.pre_quant_scale is None or not torch.equal(p.pre_quant_scale, pqs) for p in parts
    ):
        raise UsageError(f"{name}: fused linears carry different pre-quant scales")
    if first.scheme.strategy == "tensor":  # one scale for the fused GEMM
        scale = torch.stack([p.scale.max() for p in parts if p.scale is not None]).max()
        codes, moved = [], 0.0
        for p in parts:
            assert p.scale is not None
            if bool((p.scale == scale).all()):  # already at the fused scale: codes unchanged
                codes.append(p.weight)
                continue
            requant, change = at_scale(p, scale)
            moved = max(moved, change)
            codes.append(requant)
        if moved > 0:
            notes.append(
                f"{name}: re-quantised to one {algo} scale, max change {moved:.2e} "
                "of the largest weight"
            )
        rows = sum(p.out_features for p in parts)
        return replace(
            first,
            weight=torch.cat(codes),
            scale=scale.expand(rows, 1).contiguous(),
            input_scale=input_scale,
            bias=bias,
        )
    return replace(
        first,
        weight=weight,
        scale=_cat([p.scale for p in parts]),
        zero_point=_cat([p.zero_point for p in parts]),
        input_scale=input_scale,
        bias=bias,
    )


def _cat(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = [t for t in tensors if t is not None]
    return torch.cat(present) if present else None


def head_rows(heads: int, head_dim: int, tp: int, rank: int) -> torch.Tensor:
    """Rows of a q/k/v projection that rank `rank` holds (replicating heads when tp > heads)."""
    if heads % tp == 0:
        per = heads // tp
        return torch.arange(rank * per * head_dim, (rank + 1) * per * head_dim)
    head = rank // (tp // heads)
    return torch.arange(head * head_dim, (head + 1) * head_dim)


def shard(lin: LinearWeights, role: str, tp: int, rank: int) -> LinearWeights:
    if tp == 1:
        return lin
    if role == "row":
        width = lin.in_features // tp
        try:
            return lin.columns(rank * width, (rank + 1) * width)
        except ValueError as exc:
            raise UsageError(
                f"tensor parallel split: {exc} — choose a tp_size that divides the "
                "in_features of every linear by the group size"
            ) from exc
    rows = lin.out_features // tp
    return _row_range(lin, rank * rows, (rank + 1) * rows)


def _row_range(lin: LinearWeights, start: int, end: int) -> LinearWeights:
    """Output channels start:end as views (`LinearWeights.rows` copies what it picks): a rank's
    share of lm_head costs no second copy of it."""

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[start:end]

    return replace(lin, weight=lin.weight[start:end], scale=cut(lin.scale),
                   zero_point=cut(lin.zero_point), bias=cut(lin.bias))  # fmt: skip


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """(out, in) signed int4 codes → (out/2, in) int8 bytes, two output rows per byte (low
    nibble first): ModelOpt's packing, which TensorRT-LLM's W4A16_AWQ loader reads."""
    pairs = (codes.to(torch.int16) & 0x0F).reshape(-1, 2, codes.shape[1])
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8).view(torch.int8)


def _grow(t: torch.Tensor, size: int, dim: int, *, repeat_last: bool = False) -> torch.Tensor:
    """`t` grown to `size` along `dim`: zeros, or copies of its last slice."""
    extra = size - t.shape[dim]
    if extra <= 0:
        return t
    shape = [*t.shape]
    shape[dim] = extra
    last = t.narrow(dim, t.shape[dim] - 1, 1)
    fill = last.expand(shape) if repeat_last else torch.zeros(shape, dtype=t.dtype)
    return torch.cat([t, fill], dim)


def pad_linear(lin: LinearWeights, rows: int, cols: int) -> LinearWeights:
    """`lin` grown to `rows` × `cols` at the end with zero weights: padded outputs are 0 and
    padded inputs contribute nothing. Scales repeat the last row's (a per-tensor scale stays
    one value) and the last group's; pre-quant scales grow with ones."""
    scale, zero, pqs = lin.scale, lin.zero_point, lin.pre_quant_scale
    if scale is not None:
        scale = _grow(scale, rows, 0, repeat_last=True)
        if lin.scheme.strategy == "group":
            group = lin.scheme.group_size or lin.in_features // scale.shape[1]
            scale = _grow(scale, -(-cols // group), 1, repeat_last=True)
            zero = None if zero is None else _grow(zero, -(-cols // group), 1)
    if zero is not None:
        zero = _grow(zero, rows, 0)
    return replace(
        lin,
        weight=_grow(_grow(lin.weight, rows, 0), cols, 1),
        scale=scale,
        zero_point=zero,
        bias=None if lin.bias is None else _grow(lin.bias, rows, 0),
        pre_quant_scale=None if pqs is None else torch.cat([pqs, torch.ones(cols - len(pqs))]),
    )


def pad_groupwise(lin: LinearWeights, algo: str, role: str, tp: int) -> LinearWeights:
    """One rank's group-wise linear padded to the shapes TensorRT-LLM's group-wise layer
    creates (exclusions.padded_features): each rank's own slice, zeros after it."""
    if algo not in GROUPWISE or lin.scale is None:
        return lin
    group = lin.scheme.group_size or lin.in_features // lin.scale.shape[1]
    column = role == "column"
    w4a8 = algo == "W4A8_AWQ"
    rows = padded_features(lin.out_features * (tp if column else 1), group, tp, w4a8=w4a8)
    cols = padded_features(lin.in_features * (1 if column else tp), group, tp, w4a8=w4a8)
    return pad_linear(lin, rows // tp if column else rows, cols if column else cols // tp)
