"""Linear layers: the weight encodings the compiler emits, decoded into one canonical form.

`LinearWeights` is one projection's tensors decoded from disk (signed integer codes, per-row
scales, optional zero points, or FP8 values); `concat` stacks projections that share an input;
`dequantize` is the reference meaning of every encoding. The layers that run them without
dequantising live in kernels.py; the two here are the unquantised layer and the generic
fallback that dequantises on every call (used where no low-bit kernel fits, see kernels.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class ActivationScheme:
    """How a layer's input activations are quantised: int or float, per token or tensor."""

    type: str = "int"
    num_bits: int = 8
    strategy: str = "token"
    dynamic: bool = True
    symmetric: bool = True


@dataclass(frozen=True, slots=True)
class WeightScheme:
    """How a layer's weight is stored: dense float, integer codes or FP8, at what granularity."""

    type: str = "dense"
    num_bits: int = 16
    strategy: str = "tensor"
    group_size: int | None = None
    symmetric: bool = True
    activations: ActivationScheme | None = None


@dataclass(slots=True)
class LinearWeights:
    """One projection decoded from disk.

    weight: dense float [N, K], signed int8 codes [N, K], or float8_e4m3fn [N, K].
    scale: float32 [N, groups] (tensor and channel strategies are expanded to [N, 1]).
    zero_point: int8 [N, groups] or None; g_idx: int [K] group of each input column or None.
    """

    scheme: WeightScheme
    weight: torch.Tensor
    scale: torch.Tensor | None = None
    zero_point: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.weight.shape[1])


def concat(parts: list[LinearWeights]) -> LinearWeights | None:
    """Stack projections that share an input (q/k/v, gate/up) into one, when exact."""
    first = parts[0]
    same = all(
        p.scheme == first.scheme
        and p.g_idx is None
        and (p.scale is None) == (first.scale is None)
        and (p.zero_point is None) == (first.zero_point is None)
        and _same_optional(p.input_scale, first.input_scale)
        for p in parts
    )
    if not same:
        return None
    bias = None
    if any(p.bias is not None for p in parts):
        bias = torch.cat(
            [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
        )
    return replace(
        first,
        weight=torch.cat([p.weight for p in parts]),
        scale=_cat_optional([p.scale for p in parts]),
        zero_point=_cat_optional([p.zero_point for p in parts]),
        bias=bias,
    )


def _cat_optional(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = [t for t in tensors if t is not None]
    return torch.cat(present) if present else None


def _same_optional(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and bool(torch.equal(a, b))


def dequantize(w: LinearWeights, dtype: torch.dtype) -> torch.Tensor:
    """The float weight [N, K] an encoding stands for: (code - zero) * scale."""
    if w.scale is None:
        return w.weight.to(dtype)
    codes = w.weight.to(torch.float32)
    groups = w.scale.shape[1]
    if w.g_idx is not None:
        index = w.g_idx.long()
    else:
        index = torch.arange(w.in_features, device=codes.device) // (w.in_features // groups)
    if w.zero_point is not None:
        codes = codes - w.zero_point.to(torch.float32)[:, index]
    return (codes * w.scale.to(torch.float32)[:, index]).to(dtype)


class Linear:
    """y = x W^T (+ b) for x [tokens, in_features] in the model's compute dtype."""

    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class DenseLinear(Linear):
    """Unquantised weight in the compute dtype."""

    def __init__(self, w: LinearWeights, dtype: torch.dtype, device: torch.device) -> None:
        self.weight = w.weight.to(device=device, dtype=dtype).contiguous()
        self.bias = bias_of(w, dtype, device)
        self.out_features = w.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class DequantLinear(Linear):
    """Integer codes kept in memory, dequantised to the compute dtype on every call."""

    def __init__(self, w: LinearWeights, dtype: torch.dtype, device: torch.device) -> None:
        self.w = weights_to(w, device)
        self.dtype = dtype
        self.bias = bias_of(w, dtype, device)
        self.out_features = w.out_features

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(self.w, self.dtype), self.bias)


class SplitLinear(Linear):
    """Projections that share an input but could not be stacked: run each, concatenate."""

    def __init__(self, parts: list[Linear]) -> None:
        self.parts = parts
        self.out_features = sum(p.out_features for p in parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


def bias_of(w: LinearWeights, dtype: torch.dtype, device: torch.device) -> torch.Tensor | None:
    return None if w.bias is None else w.bias.to(device=device, dtype=dtype)


def weights_to(w: LinearWeights, device: torch.device) -> LinearWeights:
    """The same encoding with every tensor on `device`."""

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return LinearWeights(
        w.scheme,
        w.weight.to(device),
        move(w.scale),
        move(w.zero_point),
        move(w.g_idx),
        move(w.input_scale),
        move(w.bias),
    )
