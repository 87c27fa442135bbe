"""NVFP4 numerics (Blackwell's FP4), emulated in float32 so a CPU computes what the GPU does.

NVFP4 stores e2m1 values (sign, 2 exponent bits, 1 mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6)
in blocks of 16 along the input dimension, each block with an FP8 (e4m3) scale, and one
float32 scale per tensor: x = e2m1 × block scale × global scale. Weights are quantised once
(ModelOpt's export); activations are quantised on the fly per block of 16 against a static
global scale calibrated as amax / (6 × 448). Rounding to e2m1 is to the nearest value, ties
to the even code, as ModelOpt's `NVFP4QTensor` rounds.

torch has no FP4 dtype on CPU and ModelOpt's fake quantiser for NVFP4 asserts a CUDA tensor,
so this module is ours. On disk (ModelOpt's HF export) two codes share a byte along the input
dimension: column 2j in the low nibble, 2j+1 in the high one; bit 3 of a code is its sign.
"""

from __future__ import annotations

import torch

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# Magnitudes of codes 0-7; code | 8 is the same magnitude negated.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Midpoints between neighbouring magnitudes; a tie goes to the even code.
_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """(rows, cols/2) uint8 of two codes each → (rows, cols) float32 e2m1 values."""
    data = packed.view(torch.uint8)
    codes = torch.stack([data & 0x0F, data >> 4], dim=-1).reshape(*data.shape[:-1], -1).long()
    magnitude = torch.tensor(E2M1_VALUES)[codes & 0x07]
    return torch.where(codes >= 8, -magnitude, magnitude)


def pack_e2m1(values: torch.Tensor) -> torch.Tensor:
    """(rows, cols) exact e2m1 values → (rows, cols/2) uint8, the inverse of `unpack_e2m1`."""
    magnitudes = torch.tensor(E2M1_VALUES)
    codes = (values.abs().unsqueeze(-1) == magnitudes).int().argmax(-1)
    codes = (codes | torch.signbit(values).int() << 3).to(torch.uint8)
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """`x` (float32, already divided by its scale) rounded to the nearest e2m1 value."""
    a = x.abs().clamp(max=E2M1_MAX)
    midpoints = torch.tensor(_MIDPOINTS, device=x.device)
    index = torch.bucketize(a, midpoints)  # ties fall to the lower value ...
    odd_tie = (a.unsqueeze(-1) == midpoints[1::2]).any(-1)  # ... except onto an odd code
    index = index + odd_tie.long()
    return torch.tensor(E2M1_VALUES, device=x.device)[index] * torch.sign(x)


def block_scales(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Per-block scales (FP8-rounded, × the global scale) of `x` [..., K], K a multiple of 16:
    the block's amax maps to e2m1's largest value."""
    blocks = x.reshape(*x.shape[:-1], -1, BLOCK)
    fp8 = blocks.abs().amax(-1) / (E2M1_MAX * global_scale)
    fp8 = fp8.clamp(max=E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)
    return torch.where(fp8 == 0, torch.ones_like(fp8), fp8) * global_scale


def fake_quantize(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """`x` quantised to NVFP4 against `global_scale` and back (float32 result): what the
    GPU's FP4 GEMM sees of an activation."""
    xf = x.float()
    width = xf.shape[-1]
    pad = -width % BLOCK
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    scale = block_scales(xf, global_scale.float()).repeat_interleave(BLOCK, dim=-1)
    return (round_e2m1(xf / scale) * scale)[..., :width]
