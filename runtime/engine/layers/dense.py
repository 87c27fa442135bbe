"""DenseLinear: the unquantised layer, and the copies of its weight it keeps on CPU.

The weight is held once in oneDNN's blocked layout where oneDNN runs its dtype, and beside
it, for calls of a few rows, in kiln's AMX tiles or bf16 panels (runtime/engine/native/csrc/); on
CPUs with AVX512-BF16 but no AMX once, in kiln's pairs. kiln's copies sit in huge pages
(allocator.in_huge_pages); which copy serves which row count, and why, is DenseLinear's docstring.
The module-level switches turn each copy off for the benchmarks that compare them
(tests/benchmarks/runtime_dtype.py).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kiln.runtime.engine import native
from kiln.runtime.engine.allocator import in_huge_pages
from kiln.runtime.engine.layers.linear import Linear, bias_of, onednn_runs_bf16
from kiln.runtime.formats.weights import LinearWeights


class DenseLinear(Linear):
    """Unquantised weight in the compute dtype.

    On CPU the weight is reordered once, at load, into oneDNN's blocked GEMM layout
    (`mkldnn._linear_pointwise`, the kernel torch.compile's CPU weight-prepacking pass
    emits); F.linear re-blocks it on every call.

    - bfloat16 where oneDNN runs bf16 and the CPU has AMX: up to `AMX_MAX_ROWS` rows (decode
      steps) run on kiln's AMX kernel (runtime/engine/native/csrc/amx_linear.cpp), which holds a
      second copy of the weight in tiles; more rows (prefill) on oneDNN's packed weight. oneDNN's
      bf16 GEMM carries a fixed cost per call and reads a small projection's weight at 6-8 GB/s when
      few rows meet it, where a stream of tile loads nears the core's read bandwidth (SmolLM2-135M's
      shapes, one thread, a 2-core Xeon with AMX: a decode step's projections at 32 rows 28-32 vs
      40-45 ms, at one row 19-25 vs 26-36 ms).
    - bfloat16 on CPUs with AVX512-BF16 but no AMX: every row count runs on kiln's
      AVX512-BF16 kernel (runtime/engine/native/csrc/dpbf16_linear.cpp), whose pairs of k are the
      layer's only copy. oneDNN's bf16 GEMM leaves the dot-product units a quarter idle at a decode
      step's row counts and carries a fixed cost per call (SmolLM2-135M's shapes, one thread, a
      2-core Zen 4 EPYC, tests/benchmarks/runtime_linear.py: a step's projections at 32 rows 43.8 vs
      49.9 ms, at 8 rows 15.7 vs 21.7, at 2 rows 10.0 vs 23.0, at one row 11.3 vs 20.6). The LM head
      too: a whole decode step with it on the pairs vs on oneDNN, two engines stepped in turn
      (medians of 80), at 32 rows 60.6 vs 62.7 ms, at 8 rows 20.6 vs 21.9; the greedy head's int8
      screen recomputes its candidates from the pairs (greedy_head.py). At prefill sizes the kernel
      matches or passes oneDNN (a whole prefill step of 512 tokens, same EPYC, medians of alternate
      steps: one thread 565 vs 583 ms, two 304 vs 316; of 2048 tokens 2342 vs 2375 and 1161 vs
      1173), so oneDNN's packed copy is not kept: the weight is held once. `DPBF16_ONLY` False keeps
      it beside the pairs, which then serve up to `DPBF16_MAX_ROWS` rows (the benchmarks compare
      both).
    - Where kiln's few-row copy sits beside oneDNN's (AMX tiles, single-row panels, pairs
      with `DPBF16_ONLY` False) the layer holds its weight twice (bf16 both times), so the
      few-row copies of a process stay within 1/`ONE_ROW_MEMORY_SHARE` of the machine's
      memory; layers past it (a model too large for it) hold one copy and run every row
      count on oneDNN.
    - bfloat16 where oneDNN does not (no AVX512-BF16 or AMX) but AVX2 and FMA are there:
      kiln's own kernel (runtime/engine/native/csrc/bf16_linear.cpp) keeps the weight bf16 in
      panels, widens it in registers and accumulates in float32, holding the weight once. torch's
      bf16 matmul there is a generic loop (3-5x slower than float32 from 32 rows); kiln's kernel
      reads half float32's bytes, which is what a decode step at a few rows waits on.
    - float32: inputs of `PACKED_MIN_ROWS` rows or more run on the packed copy (30 layers
      at 4 rows 55 vs 88 ms, at 32 rows 152 vs 182 ms; the LM head at 32 rows 32 vs 42 ms);
      at one row MKL's gemv on the plain weight is ~15% faster, so single-token decode keeps
      it, stored column-major (the [N, K] view of a contiguous [K, N]: MKL's gemv then
      streams an untransposed matrix, 30 layers 27.6 vs 29.3 ms, LM head 5.9 vs 7.6 ms per
      token). The cost is memory: a float32 layer holds its weight twice.

    Results differ from F.linear only in summation order.
    """

    PACKED_MIN_ROWS = 4

    def __init__(self, w: LinearWeights, dtype: torch.dtype, device: torch.device) -> None:
        weight = w.weight.to(device=device, dtype=dtype).contiguous()
        self.bias = bias_of(w, dtype, device)
        self.out_features = w.out_features
        self.in_features = w.in_features
        self.panels: torch.Tensor | None = None
        self.amx: torch.Tensor | None = None
        self.pairs: torch.Tensor | None = None
        # the pairs alone where the CPU has AVX512-BF16 but no AMX (with AMX: its tiles)
        only_pairs = DPBF16_ONLY and _dpbf16_serves(weight) and not native.amx_kernels_available()
        self.packed = None if only_pairs else _onednn_pack(weight)
        if only_pairs:
            self.pairs = _dpbf16_pack(weight)
        elif self.packed is None:
            self.panels = _bf16_panels(weight)
        elif _amx_serves(weight):
            self.amx = _few_rows_copy(self, weight, _amx_pack)
        elif _dpbf16_serves(weight):
            self.pairs = _few_rows_copy(self, weight, _dpbf16_pack)
        else:
            self.panels = _few_rows_copy(self, weight, _bf16_panels)
        # Rows up to which kiln's kernel serves the layer: every row count where it holds the
        # only copy, a single row (panels) or DPBF16_MAX_ROWS (pairs) beside oneDNN's weight.
        self.panel_max_rows = 1 if self.packed is not None else torch.iinfo(torch.int64).max
        self.pair_max_rows = DPBF16_MAX_ROWS if self.packed is not None else self.panel_max_rows
        self.packed_min_rows = self.PACKED_MIN_ROWS
        self.weight: torch.Tensor | None = weight
        kiln_copy = self.panels is not None or self.pairs is not None
        if kiln_copy or (self.packed is not None and dtype == torch.bfloat16):
            self.packed_min_rows, self.weight = 0, None
        elif self.packed is not None:
            self.weight = weight.t().contiguous().t()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.amx is not None and rows <= AMX_MAX_ROWS and x.dtype == torch.bfloat16:
            return torch.ops.kiln.amx_linear(x, self.amx, self.out_features, self.bias)
        if self.pairs is not None and rows <= self.pair_max_rows:
            return torch.ops.kiln.dpbf16_linear(x, self.pairs, self.out_features, self.bias)
        if self.panels is not None and rows <= self.panel_max_rows:
            return torch.ops.kiln.bf16_linear(x, self.panels, self.out_features, self.bias)
        if self.weight is None or (self.packed is not None and rows >= self.packed_min_rows):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def weight_bytes(self) -> int:
        # the copy a single row reads: kiln's AMX tiles, pairs or panels, else the plain
        # weight, else oneDNN's
        copies = (self.amx, self.pairs, self.panels, self.weight, self.packed)
        held = next(t for t in copies if t is not None)
        return held.nbytes + (0 if self.bias is None else self.bias.nbytes)


# kiln's bf16-weight kernel where it serves the CPU (False: torch's bf16 matmul, for comparison).
BF16_PANELS = True
# Beside oneDNN's packed bf16 weight, kiln's panels for single-row calls (False: oneDNN only).
ONE_ROW_PANELS = True
# Beside oneDNN's packed bf16 weight on CPUs with AMX, kiln's AMX tiles for calls of up to
# AMX_MAX_ROWS rows, in place of the single-row panels (False: as on CPUs without AMX).
AMX_LINEAR = True
AMX_MAX_ROWS = 64
# On CPUs with AVX512-BF16 but no AMX, kiln's pairs (False: oneDNN's packed weight beside
# single-row panels, as before). DPBF16_ONLY: the pairs are the only copy and serve every row
# count (False: beside oneDNN's packed weight, for calls of up to DPBF16_MAX_ROWS rows).
DPBF16_LINEAR = True
DPBF16_ONLY = True
DPBF16_MAX_ROWS = 64
# The few-row copies (panels, pairs or AMX tiles) of all layers in a process stay within 1/this of
# physical memory.
ONE_ROW_MEMORY_SHARE = 8
_one_row_lock = threading.Lock()
_one_row_held = [0]  # bytes of few-row copies held now


def _few_rows_copy(
    layer: DenseLinear,
    weight: torch.Tensor,
    pack: Callable[[torch.Tensor], torch.Tensor | None],
) -> torch.Tensor | None:
    """`pack(weight)`, kiln's copy for few-row calls of a layer that also holds oneDNN's
    packed weight, while the process's few-row copies fit their share of memory; released
    with the layer."""
    if not ONE_ROW_PANELS or weight.dtype != torch.bfloat16:
        return None
    budget = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // ONE_ROW_MEMORY_SHARE
    with _one_row_lock:
        if _one_row_held[0] + weight.nbytes > budget:
            return None
        copy = pack(weight)
        if copy is None:
            return None
        _one_row_held[0] += copy.nbytes
    weakref.finalize(layer, _release_one_row, copy.nbytes)
    return copy


def _release_one_row(nbytes: int) -> None:
    with _one_row_lock:
        _one_row_held[0] -= nbytes


def _amx_serves(weight: torch.Tensor) -> bool:
    """Whether a bf16 CPU weight beside oneDNN's copy gets kiln's AMX tiles for few rows."""
    return (
        AMX_LINEAR
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and native.amx_kernels_available()
    )


def _dpbf16_serves(weight: torch.Tensor) -> bool:
    """Whether a bf16 CPU weight can get kiln's pairs (the CPU has AVX512-BF16)."""
    return (
        DPBF16_LINEAR
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.dim() == 2
        and native.dpbf16_kernels_available()
    )


def _dpbf16_pack(weight: torch.Tensor) -> torch.Tensor:
    return in_huge_pages(torch.ops.kiln.dpbf16_pack(weight))


def _amx_pack(weight: torch.Tensor) -> torch.Tensor:
    return in_huge_pages(torch.ops.kiln.amx_pack(weight))


def _bf16_panels(weight: torch.Tensor) -> torch.Tensor | None:
    """A bf16 CPU weight in kiln's panel layout, where its kernel serves this CPU, else None."""
    if not BF16_PANELS or weight.device.type != "cpu" or weight.dtype != torch.bfloat16:
        return None
    if weight.dim() != 2:
        return None
    if not native.avx2_kernels_available():
        return None
    return in_huge_pages(torch.ops.kiln.bf16_pack(weight))


# The row count oneDNN tunes its packed layout for; any row count runs on it.
PACK_ROWS_HINT = 32
PACKED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)


def _onednn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The weight reordered for oneDNN's CPU GEMM, or None where that does not apply."""
    if (
        weight.device.type != "cpu"
        or weight.dtype not in PACKED_DTYPES
        or weight.dim() != 2
        or not torch.backends.mkldnn.is_available()
    ):
        return None
    try:
        if weight.dtype == torch.bfloat16 and not onednn_runs_bf16():
            return None
        return torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS_HINT)
    except (RuntimeError, AttributeError):  # a torch build without the op: plain F.linear
        return None
