"""Rounding weights to FP8 on the CPU as compressed-tensors does, an order of magnitude sooner.

compressed-tensors compresses each FP8 weight at save time through `_quantize`
(quantization/lifecycle/forward_helpers.py): divide by the scale, clamp with the range held in
tensors, cast to float8_e4m3fn, cast back to the divided dtype, then to float8 again. On a CPU
every one of those passes is a whole-weight temporary in float32, and clamping against tensor
bounds and casting out of float8 are not vectorised: 83-88 ms for a [5632, 2048] weight on a
2-core Xeon, 6-8 s of the save of a 1.2B model. Its only accelerated implementation is a
Triton kernel for GPUs.

`_quantize` is a dispatch point of compressed-tensors' own backend registry (`ImplBackend`),
so kiln registers a CPU implementation there for the case it covers, and every other case goes
on to the library's: the same divide into the same promoted dtype, the same zero-point add,
the clamp with the bounds as numbers (exact in that dtype), one cast to float8 - a block of
rows at a time through one buffer that stays in cache. The round trip through the divided
dtype is left out because every float8 value is exact in it; a block holding a NaN is cast by
the library's own steps (which NaN a cast keeps differs between torch's cast paths). The codes
are the library's, bit for bit (tests/quant/test_fp8_cpu.py compares them, NaN, infinities,
signed zeros and subnormals included); 9.3 ms for the same weight. Hand-written: no library
has a CPU kernel for this.
"""

from __future__ import annotations

import inspect
import threading
from typing import Any

import torch

BLOCK_BYTES = 4 << 20  # the divided rows held at once: within a core's share of the cache
FP8 = torch.float8_e4m3fn

_registered = threading.Lock()
_done: list[bool] = []


def _rows_only(t: torch.Tensor | None, x: torch.Tensor) -> bool:
    """Whether `t` broadcasts against `x` as one value or one per row (what slicing by rows
    keeps exact), so a block of rows can take its own rows of `t`."""
    if t is None or t.numel() == 1:
        return True
    return t.dim() == 2 and t.shape == (x.shape[0], 1)


def _bounds_exact(low: Any, high: Any, dtype: torch.dtype) -> bool:
    """Whether the clamp's bounds are single numbers exactly representable in `dtype` (so
    clamping against them as numbers is clamping against the library's tensors)."""
    if low.numel() != 1 or high.numel() != 1:
        return False
    for bound in (low, high):
        value = float(bound)
        if torch.tensor(value, dtype=dtype).item() != value:
            return False
    return True


def _rows(t: torch.Tensor | None, start: int, stop: int) -> torch.Tensor | None:
    if t is None or t.numel() == 1:
        return t
    return t[start:stop]


@torch.no_grad()
def round_fp8_cpu(
    x: torch.Tensor,
    scale: torch.Tensor,
    zero_point: torch.Tensor | None,
    q_min: torch.Tensor,
    q_max: torch.Tensor,
    args: Any,
    dtype: torch.dtype | None = None,
    global_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """x / scale (+ zero point), clamped to [q_min, q_max], as float8_e4m3fn codes: what
    compressed-tensors' `_quantize` returns for a call `covers` accepts."""
    rows, cols = x.shape
    divided = torch.result_type(x, scale)
    low, high = float(q_min), float(q_max)
    out = torch.empty((rows, cols), dtype=FP8)
    step = max(1, BLOCK_BYTES // (max(cols, 1) * torch.empty((), dtype=divided).element_size()))
    buffer = torch.empty((min(step, rows), cols), dtype=divided)
    for start in range(0, rows, step):
        stop = min(start + step, rows)
        block = buffer[: stop - start]
        torch.div(x[start:stop], scale if scale.numel() == 1 else scale[start:stop], out=block)
        zero = _rows(zero_point, start, stop)
        if zero is not None:
            block += zero.to(x.dtype)
        block.clamp_(low, high)
        if block.sum(dtype=torch.float32).isnan():  # clamped, so only a NaN makes it NaN
            out[start:stop] = _as_library(block, divided)
        else:
            out[start:stop].copy_(block)
    return out


def _as_library(block: torch.Tensor, divided: torch.dtype) -> torch.Tensor:
    """A block holding a NaN, cast by the library's own steps: which NaN (its sign bit) a
    cast keeps differs between torch's cast paths and the round trip through `divided`
    (bfloat16 makes every NaN positive)."""
    return block.contiguous().to(FP8).to(divided).to(FP8)


def covers(*given: Any, **named: Any) -> bool:
    """Whether `round_fp8_cpu` computes this call of compressed-tensors' `_quantize` (the
    registry hands both the call's arguments): float8 codes asked for, of a 2-D CPU weight, a
    scale (and zero point) per tensor or per row."""
    from compressed_tensors.quantization.quant_args import QuantizationType

    call = inspect.signature(round_fp8_cpu).bind(*given, **named)
    call.apply_defaults()
    a = call.arguments
    x, scale, zero_point, args = a["x"], a["scale"], a["zero_point"], a["args"]
    return (
        a["dtype"] == FP8
        and a["global_scale"] is None
        and getattr(args, "type", None) == QuantizationType.FLOAT
        and getattr(args, "num_bits", None) == 8
        and isinstance(x, torch.Tensor)
        and x.device.type == "cpu"
        and x.dim() == 2
        and x.is_floating_point()
        and scale.device.type == "cpu"
        and _rows_only(scale, x)
        and (zero_point is None or zero_point.device.type == "cpu")
        and _rows_only(zero_point, x)
        and _bounds_exact(a["q_min"], a["q_max"], torch.result_type(x, scale))
    )


def register() -> None:
    """Make compressed-tensors round FP8 weights with `round_fp8_cpu` where it covers the call
    (once per process; after the library's own backends, which need a GPU). A
    compressed-tensors without that registry keeps its own rounding."""
    with _registered:
        if _done:
            return
        try:
            from compressed_tensors.utils.impl_backend import ImplBackend
        except ImportError:
            return
        ImplBackend.register("_quantize", covers, priority=1)(round_fp8_cpu)
        _done.append(True)
