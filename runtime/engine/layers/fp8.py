"""FP8 weights and activations (`Fp8Linear`): `torch._scaled_mm` on CUDA, an exact
dequantised path on CPU."""

from __future__ import annotations

import torch

from kiln.runtime.engine.layers.linear import (
    Linear,
    bias_of,
    float_linear,
)
from kiln.runtime.engine.layers.shared import nonzero
from kiln.runtime.formats.weights import LinearWeights

FP8_MAX = 448.0


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
            return nonzero(x.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX)
        return nonzero(x.abs().amax().float() / FP8_MAX).reshape(1, 1)

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
