"""What the quantised layers share: whether the tile unit serves a bf16 layer, a check that
every group is whole, and a scale that is never zero."""

from __future__ import annotations

import torch

from kiln.runtime.engine import native
from kiln.runtime.formats.weights import LinearWeights


def whole_groups(w: LinearWeights) -> bool:
    """True when every group has exactly group_size columns (always so without g_idx)."""
    if w.g_idx is None or w.scale is None:
        return True
    counts = torch.bincount(w.g_idx.long(), minlength=w.scale.shape[1])
    return bool((counts == w.in_features // w.scale.shape[1]).all())


def nonzero(scale: torch.Tensor) -> torch.Tensor:
    return torch.where(scale == 0, torch.finfo(torch.float32).eps, scale)


def on_amx_tiles(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a bf16 model's W4A16 and W8A16 layers multiply on the tile unit from their
    `AMX_ROWS` rows up (runtime/engine/native/csrc/amx_linear.cpp's `int4_amx_linear`,
    `int8_amx_linear`): CPUs where kiln's AMX kernels load. The output is rounded to bf16, so a
    float32 model keeps the other paths."""
    return device.type == "cpu" and dtype == torch.bfloat16 and native.amx_kernels_available()
