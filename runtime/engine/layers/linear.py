"""The generic linear layers: the fallback that dequantises on every call (where no
low-bit kernel fits, see kernels.py), the wrappers that split or pre-scale a layer's input,
and float GEMMs that stay fast on CPUs whose oneDNN cannot multiply bf16.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from kiln.runtime.formats.weights import LinearWeights, dequantize, weights_to


class Linear:
    """y = x W^T (+ b) for x [tokens, in_features] in the model's compute dtype."""

    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def weight_bytes(self) -> int:
        """Bytes of weights one single-row call reads (for memory-roofline estimates): by
        default every tensor the layer holds; layers keeping a second copy for another path
        count only the one-row path's."""
        return sum(t.nbytes for t in vars(self).values() if isinstance(t, torch.Tensor))


@functools.cache
def onednn_runs_bf16() -> bool:
    """Whether oneDNN computes bf16 GEMMs on this CPU (AVX512-BF16, AMX): elsewhere torch's
    bf16 matmul is a generic loop, and a float32 GEMM is the faster way to multiply."""
    try:
        return bool(
            torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        )
    except (RuntimeError, AttributeError):
        return False


def float_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear, run in float32 when bf16 operands meet a CPU whose oneDNN cannot multiply
    bf16 (the same float32 accumulation and one rounding of the result back to bf16; torch's
    bf16 matmul there is a generic loop, 3-5x slower than float32 from 32 rows)."""
    if x.dtype != torch.bfloat16 or x.device.type != "cpu" or onednn_runs_bf16():
        return F.linear(x, weight, bias)
    b = None if bias is None else bias.float()
    return F.linear(x.float(), weight.float(), b).to(torch.bfloat16)


class DequantLinear(Linear):
    """Integer codes kept in memory, dequantised to the compute dtype on every call."""

    def __init__(self, w: LinearWeights, dtype: torch.dtype, device: torch.device) -> None:
        self.w = weights_to(w, device)
        self.dtype = dtype
        self.bias = bias_of(w, dtype, device)
        self.out_features = w.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return float_linear(x, dequantize(self.w, self.dtype), self.bias)

    def weight_bytes(self) -> int:
        w = self.w
        held = (w.weight, w.scale, w.zero_point, w.g_idx, w.bias)
        return sum(t.nbytes for t in held if t is not None)


class PreScaledLinear(Linear):
    """A layer whose input is first multiplied per column by the checkpoint's pre-quant scale
    (AWQ and SmoothQuant exports that keep it separate): the scale must act before any
    activation quantisation, so it cannot be folded into the weight."""

    def __init__(
        self, inner: Linear, pre_quant_scale: torch.Tensor, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.inner = inner
        self.pre_quant_scale = pre_quant_scale.to(device=device, dtype=dtype)
        self.out_features = inner.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.inner(x * self.pre_quant_scale)

    def weight_bytes(self) -> int:
        return self.inner.weight_bytes() + self.pre_quant_scale.nbytes


class SplitLinear(Linear):
    """Projections that share an input but could not be stacked: run each, concatenate."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)

    def weight_bytes(self) -> int:
        return sum(p.weight_bytes() for p in self.parts)


def bias_of(w: LinearWeights, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    return None if w.bias is None else w.bias.to(device=device, dtype=dtype)
