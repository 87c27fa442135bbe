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

from kiln.runtime.engine.layers.dense import DenseLinear
from kiln.runtime.engine.layers.fp8 import Fp8Linear
from kiln.runtime.engine.layers.int4 import Int4Linear
from kiln.runtime.engine.layers.int8 import Int8GroupLinear, Int8Linear, Int8WeightLinear
from kiln.runtime.engine.layers.linear import (
    DequantLinear,
    Linear,
    PreScaledLinear,
    SplitLinear,
)
from kiln.runtime.engine.layers.nvfp4 import Nvfp4Linear
from kiln.runtime.formats.weights import LinearWeights, concat

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
