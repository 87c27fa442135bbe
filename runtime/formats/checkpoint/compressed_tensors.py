"""compressed-tensors checkpoints (what llm-compressor writes), read without that package.

config.json `quantization_config` (quant_method "compressed-tensors"): per config group a
`format` (pack-quantized, int-quantized, float-quantized, naive-quantized, dense), `targets`
(class names such as "Linear", or "re:" regexes matched from the start of the module name)
and the `weights` / `input_activations` schemes; `ignore`; `kv_cache_scheme`. Per layer:
`weight_packed` (int32, dense little-endian bit packing of code + 2^(bits-1)),
`weight_shape`, `weight_scale`, `weight_zero_point` (packed along the output dimension when
asymmetric), `weight_g_idx`, `input_scale`; per attention layer `k_scale` and `v_scale` for
a quantised KV cache.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from kiln.runtime.base.errors import ArtifactError
from kiln.runtime.formats.weights import ActivationScheme, LinearWeights, WeightScheme, row_scales

if TYPE_CHECKING:
    from kiln.runtime.formats.checkpoint.files import TensorFiles

STORED_CODES = ("int-quantized", "naive-quantized", "float-quantized")


@dataclass(slots=True)
class ConfigGroup:
    format: str
    targets: list[str]
    weights: WeightScheme
    actorder: bool = False  # GPTQ recorded an activation order (its groups may interleave)


@dataclass(slots=True)
class CompressedTensors:
    """The `quantization_config` of a compressed-tensors checkpoint."""

    source: str
    groups: list[ConfigGroup] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    kv_cache: str | None = None  # "fp8" or "int8"
    name: str = "compressed-tensors"
    quant_algo: str | None = None  # compressed-tensors records no TensorRT-LLM name

    @classmethod
    def from_config(cls, data: dict[str, Any], model_dir: Path) -> CompressedTensors:
        source = str(model_dir)
        groups = []
        for name, group in (data.get("config_groups") or {}).items():
            fmt = group.get("format") or data.get("format") or "dense"
            weights = _weight_scheme(group.get("weights"), group.get("input_activations"))
            if group.get("output_activations"):
                raise ArtifactError(
                    f"{source}: config group {name}: output activations unsupported"
                )
            actorder = bool((group.get("weights") or {}).get("actorder"))
            groups.append(ConfigGroup(fmt, list(group.get("targets") or []), weights, actorder))
        kv = _kv_cache(data.get("kv_cache_scheme"), source)
        return cls(source, groups, list(data.get("ignore") or []), kv)

    def scheme_for(self, module: str) -> ConfigGroup | None:
        """The config group that quantises a Linear module, or None for a dense one."""
        if any(_matches(module, target) for target in self.ignore):
            return None
        for group in self.groups:
            if any(_matches(module, target) for target in group.targets):
                return group
        return None

    def quantised(self, files: TensorFiles, module: str) -> bool:
        group = self.scheme_for(module)
        if group is None or group.format == "dense":
            if group is not None and group.weights.activations is not None:
                raise ArtifactError(
                    f"{self.source}: {module}: dense weights with quantised activations "
                    "are not supported; re-export the checkpoint compressed"
                )
            return False
        return f"{module}.weight_scale" in files

    def linear(self, files: TensorFiles, module: str) -> LinearWeights:
        """Decode one Linear's tensors into signed codes, per-row scales and zero points."""
        group = self.scheme_for(module)
        assert group is not None
        scheme = group.weights
        shape: tuple[int, ...]
        if group.format == "pack-quantized":
            shape = tuple(int(v) for v in files.get(f"{module}.weight_shape").tolist())
            codes = unpack(files.get(f"{module}.weight_packed"), scheme.num_bits, shape[1])
        elif group.format in STORED_CODES:
            stored = files.get(f"{module}.weight")
            codes = stored if scheme.type == "float" else stored.to(torch.int8)
            shape = tuple(codes.shape)
        else:
            raise ArtifactError(
                f"{self.source}: {module}: compressed-tensors format {group.format!r} is not "
                f"supported (pack-quantized, {', '.join(STORED_CODES)})"
            )
        rows = shape[0]
        scale = row_scales(files.get(f"{module}.weight_scale"), rows)
        zero = files.maybe(f"{module}.weight_zero_point")
        if zero is not None:
            if group.format == "pack-quantized" and zero.dtype == torch.int32:
                zero = unpack(zero.t(), scheme.num_bits, rows).t()
            zero = zero.to(torch.int8).reshape(rows, -1).expand(rows, scale.shape[1])
            zero = None if not bool(zero.any()) else zero.contiguous()
        g_idx = files.maybe(f"{module}.weight_g_idx")
        if g_idx is not None and torch.equal(
            g_idx.long(), torch.arange(shape[1]) // (shape[1] // scale.shape[1])
        ):
            g_idx = None
        input_scale = files.maybe(f"{module}.input_scale")
        if input_scale is not None:
            input_scale = input_scale.to(torch.float32).reshape(())
        return LinearWeights(scheme, codes, scale, zero, g_idx, input_scale)

    def served(self, files: TensorFiles, module: str, stored: LinearWeights) -> LinearWeights:
        return stored  # every scheme's kernels compute with the stored values

    def kv_scale_names(self, layer: int) -> tuple[str, str]:
        prefix = f"model.layers.{layer}.self_attn"
        return f"{prefix}.k_scale", f"{prefix}.v_scale"


def _kv_cache(scheme: dict[str, Any] | None, source: str) -> str | None:
    """The KV-cache encoding a kv_cache_scheme asks for: FP8 or INT8 codes, static scales."""
    if not scheme:
        return None
    kind = scheme.get("type", "float")
    bits = int(scheme.get("num_bits", 8))
    if bits != 8 or kind not in ("float", "int") or not scheme.get("symmetric", True):
        raise ArtifactError(
            f"{source}: kv_cache_scheme {scheme} is not supported (8-bit symmetric float or int)"
        )
    if scheme.get("dynamic"):
        raise ArtifactError(f"{source}: dynamic KV-cache scales are not supported")
    return "fp8" if kind == "float" else "int8"


def _weight_scheme(weights: dict[str, Any] | None, acts: dict[str, Any] | None) -> WeightScheme:
    activations = None
    if acts:
        activations = ActivationScheme(
            type=acts.get("type", "int"),
            num_bits=int(acts.get("num_bits", 8)),
            strategy=acts.get("strategy") or "tensor",
            dynamic=bool(acts.get("dynamic", False)),
            symmetric=bool(acts.get("symmetric", True)),
        )
    if not weights:
        return WeightScheme(activations=activations)
    return WeightScheme(
        type=weights.get("type", "int"),
        num_bits=int(weights.get("num_bits", 8)),
        strategy=weights.get("strategy") or "tensor",
        group_size=weights.get("group_size"),
        symmetric=bool(weights.get("symmetric", True)),
        activations=activations,
    )


def _matches(module: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target in (module, "Linear")


def unpack(packed: torch.Tensor, bits: int, columns: int) -> torch.Tensor:
    """Signed int8 codes [rows, columns] from rows of densely bit-packed int32 words.

    Element i of a row sits at bits [i*bits, (i+1)*bits) of the row's little-endian bit
    stream, stored as code + 2^(bits-1); an element may straddle two words.
    """
    words = packed.to(torch.int64) & 0xFFFFFFFF
    rows = words.shape[0]
    start = torch.arange(columns, dtype=torch.int64) * bits
    index, offset = start // 32, start % 32
    if 32 % bits == 0:
        values = words[:, index] >> offset
    else:
        following = torch.cat([words, torch.zeros(rows, 1, dtype=torch.int64)], dim=1)
        values = (words[:, index] | (following[:, index + 1] << 32)) >> offset
    codes = (values & ((1 << bits) - 1)) - (1 << (bits - 1))
    return codes.to(torch.int8)
