"""W4A8 AWQ numerics (ModelOpt's W4A8_AWQ export) as TensorRT-LLM's GEMM computes them.

The GPU has no int4 x FP8 product: TensorRT-LLM's W4A8 AWQ layer (tensorrt_llm/_torch/modules/
linear.py, `W4A8_AWQ_LinearMethod`) holds each group scale as float16 divided by the per-tensor
`weight_scale_2`, turns every int4 code into float16 code × that scale and that into FP8 e4m3,
and multiplies FP8 weights by FP8 activations (the input × `pre_quant_scale`, divided by the
static `input_scale`), rescaling by input_scale × weight_scale_2. So the weight that ships is
w = e4m3(fp16(q × fp16(fp16(s) / weight_scale_2))) × weight_scale_2, not q × s: the FP8
rounding (3 mantissa bits) is part of the values. ModelOpt's own fake quantiser for W4A8
(an int4 block quantiser followed by a per-tensor FP8 one) rounds the same way, in float32.

So a W4A8 AWQ linear is served as an FP8 per-tensor linear with static FP8 activations
(`kernels.Fp8Linear`, behind `PreScaledLinear` where a pre-quant scale is kept), its weight
the FP8 values above: what the GPU multiplies. Rounding to e4m3 is to nearest, ties to even,
saturating at ±448, as torch's cast and the GPU's conversion round.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kiln.runtime.formats.weights import LinearWeights, WeightScheme

FP8_MAX = 448.0


def fp8_weights(w: LinearWeights, weight_scale_2: torch.Tensor) -> LinearWeights:
    """A W4A8 AWQ linear (signed int4 codes, [N, groups] scales) as the FP8 per-tensor linear
    TensorRT-LLM multiplies: e4m3 weight [N, K] with `weight_scale_2` as its scale; input and
    pre-quant scales kept."""
    assert w.scale is not None and w.scheme.group_size is not None
    second = weight_scale_2.to(torch.float32).reshape(())
    group_scale = (w.scale.to(torch.float16).to(torch.float32) / second).to(torch.float16)
    columns = torch.arange(w.in_features) // w.scheme.group_size
    product = w.weight.to(torch.float16) * group_scale[:, columns]  # rounded to float16
    codes = product.to(torch.float32).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return replace(
        w,
        scheme=WeightScheme("float", 8, "tensor", activations=w.scheme.activations),
        weight=codes,
        scale=second.expand(w.out_features, 1).contiguous(),
        zero_point=None,
    )
