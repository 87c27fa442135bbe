"""NVFP4 (`Nvfp4Linear`): the values Blackwell's FP4 GEMM multiplies, emulated exactly."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.runtime.engine.layers.linear import (
    Linear,
    bias_of,
)
from kiln.runtime.formats import nvfp4
from kiln.runtime.formats.weights import LinearWeights, dequantize, weights_to


class Nvfp4Linear(Linear):
    """NVFP4 weights and activations, emulated: y = fq(x) @ W^T in float32 (see above)."""

    def __init__(self, w: LinearWeights, dtype: torch.dtype, device: torch.device) -> None:
        assert w.input_scale is not None
        self.weight = dequantize(weights_to(w, device), torch.float32)
        self.input_scale = w.input_scale.float().to(device)
        self.bias = bias_of(w, torch.float32, device)
        self.dtype = dtype
        self.out_features = w.out_features

    @staticmethod
    def supports(w: LinearWeights, device: torch.device) -> bool:
        a = w.scheme.activations
        return (
            w.scheme.type == "float"
            and w.scheme.num_bits == 4
            and w.scheme.group_size == nvfp4.BLOCK
            and a is not None
            and a.num_bits == 4
            and w.input_scale is not None
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(nvfp4.fake_quantize(x, self.input_scale), self.weight, self.bias)
        return y.to(self.dtype)
