"""Read a Hugging Face checkpoint directory (config.json + safetensors) into a CausalLM.

Quantised checkpoints in the compressed-tensors format (what llm-compressor writes) are read
here directly: the runtime must not depend on the compressed-tensors package, and the on-disk
format is small: per config group a `format` (pack-quantized, int-quantized, float-quantized,
naive-quantized, dense), `targets` (class names such as "Linear", or "re:" regexes matched
from the start of the module name) and `ignore`; per layer `weight_packed` (int32, dense
little-endian bit packing of code + 2^(bits-1)), `weight_shape`, `weight_scale`,
`weight_zero_point` (packed along the output dimension when asymmetric), `weight_g_idx`,
`input_scale`; per attention layer `k_scale` and `v_scale` for a quantised KV cache.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kiln.runtime.errors import ArtifactError
from kiln.runtime.kernels import make_linear
from kiln.runtime.linear import ActivationScheme, LinearWeights, WeightScheme
from kiln.runtime.model import CausalLM, DecoderLayer
from kiln.runtime.model_info import ModelInfo

PROJECTIONS = {
    "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o_proj": ("self_attn.o_proj",),
    "gate_up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}
DENSE = WeightScheme()


@dataclass(slots=True)
class KVCacheSpec:
    """How the checkpoint wants the KV cache stored: None (model dtype), "fp8" or "int8"."""

    quant: str | None = None
    k_scales: list[torch.Tensor] = field(default_factory=list)
    v_scales: list[torch.Tensor] = field(default_factory=list)


class Checkpoint:
    """Lazy access to the tensors of one or more safetensors files."""

    def __init__(self, model_dir: Path) -> None:
        self.dir = model_dir
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise ArtifactError(f"{model_dir}: no *.safetensors files; expected a HF checkpoint")
        self._where: dict[str, Any] = {}
        for path in files:
            handle = safe_open(str(path), framework="pt")
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a mapping
                self._where[name] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> torch.Tensor:
        handle = self._where.get(name)
        if handle is None:
            raise ArtifactError(f"{self.dir}: tensor {name} is missing from the checkpoint")
        return handle.get_tensor(name)

    def maybe(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self._where else None


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ArtifactError(f"{model_dir}: no config.json; pass a Hugging Face model directory")
    return json.loads(path.read_text())


def resolve_dtype(name: str, config: dict[str, Any], device: torch.device) -> torch.dtype:
    """The compute dtype. "auto" is float32 on CPU (no fast bf16 matmul without AVX512-BF16
    or AMX) and the checkpoint's dtype elsewhere."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cpu":
        return torch.float32
    saved = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
    return torch.float32 if saved == "float32" else getattr(torch, saved)


def load_model(
    model_dir: Path, dtype: str, device: torch.device, max_model_len: int
) -> tuple[CausalLM, KVCacheSpec]:
    """Build the model and describe its KV-cache encoding from a checkpoint directory."""
    raw = read_config(model_dir)
    config = ModelInfo.for_runtime(raw, str(model_dir))
    compute = resolve_dtype(dtype, raw, device)
    ckpt = Checkpoint(model_dir)
    quant = QuantConfig.from_hf(raw.get("quantization_config"), str(model_dir))

    def linear(prefix: str, names: tuple[str, ...]) -> Any:
        parts = [quant.read(ckpt, f"{prefix}.{n}") for n in names]
        try:
            return make_linear(parts, compute, device)
        except ValueError as exc:
            raise ArtifactError(f"{model_dir}: {prefix}: {exc}") from exc

    embed = ckpt.get("model.embed_tokens.weight").to(device=device, dtype=compute)
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        layers.append(
            DecoderLayer(
                input_norm=ckpt.get(f"{p}.input_layernorm.weight").to(device, compute),
                qkv=linear(p, PROJECTIONS["qkv"]),
                o_proj=linear(p, PROJECTIONS["o_proj"]),
                post_norm=ckpt.get(f"{p}.post_attention_layernorm.weight").to(device, compute),
                gate_up=linear(p, PROJECTIONS["gate_up"]),
                down=linear(p, PROJECTIONS["down"]),
            )
        )
    # As transformers does: a stored lm_head wins even when the config says tied.
    if "lm_head.weight" in ckpt or "lm_head.weight_packed" in ckpt:
        lm_head = linear("", ("lm_head",))
    else:
        lm_head = make_linear([LinearWeights(DENSE, embed)], compute, device)
    norm = ckpt.get("model.norm.weight").to(device, compute)
    model = CausalLM(config, embed, layers, norm, lm_head, max_model_len)
    return model, quant.kv_cache(ckpt, config)


@dataclass(slots=True)
class ConfigGroup:
    format: str
    targets: list[str]
    weights: WeightScheme


@dataclass(slots=True)
class QuantConfig:
    """The compressed-tensors `quantization_config` of a checkpoint (empty when dense)."""

    source: str
    groups: list[ConfigGroup] = field(default_factory=list)
    ignore: list[str] = field(default_factory=list)
    kv_scheme: dict[str, Any] | None = None

    @classmethod
    def from_hf(cls, data: dict[str, Any] | None, source: str) -> QuantConfig:
        if not data:
            return cls(source)
        method = data.get("quant_method")
        if method != "compressed-tensors":
            raise ArtifactError(
                f"{source}: quantization_config.quant_method {method!r} is not supported by "
                "the kiln runtime (it reads compressed-tensors checkpoints)"
            )
        groups = []
        for name, group in (data.get("config_groups") or {}).items():
            fmt = group.get("format") or data.get("format") or "dense"
            weights = _weight_scheme(group.get("weights"), group.get("input_activations"))
            if group.get("output_activations"):
                raise ArtifactError(
                    f"{source}: config group {name}: output activations unsupported"
                )
            groups.append(ConfigGroup(fmt, list(group.get("targets") or []), weights))
        return cls(source, groups, list(data.get("ignore") or []), data.get("kv_cache_scheme"))

    def scheme_for(self, module: str) -> ConfigGroup | None:
        """The config group that quantises a Linear module, or None for a dense one."""
        if any(_matches(module, target) for target in self.ignore):
            return None
        for group in self.groups:
            if any(_matches(module, target) for target in group.targets):
                return group
        return None

    def read(self, ckpt: Checkpoint, module: str) -> LinearWeights:
        """Decode one Linear's tensors into signed codes, per-row scales and zero points."""
        module = module.lstrip(".")
        group = self.scheme_for(module)
        bias = ckpt.maybe(f"{module}.bias")
        if group is None or group.format == "dense":
            if group is not None and group.weights.activations is not None:
                raise ArtifactError(
                    f"{self.source}: {module}: dense weights with quantised activations "
                    "are not supported; re-export the checkpoint compressed"
                )
            return LinearWeights(DENSE, ckpt.get(f"{module}.weight"), bias=bias)
        scheme = group.weights
        shape: tuple[int, ...]
        if group.format == "pack-quantized":
            shape = tuple(int(v) for v in ckpt.get(f"{module}.weight_shape").tolist())
            codes = unpack(ckpt.get(f"{module}.weight_packed"), scheme.num_bits, shape[1])
        elif group.format in ("int-quantized", "naive-quantized", "float-quantized"):
            stored = ckpt.get(f"{module}.weight")
            codes = stored if scheme.type == "float" else stored.to(torch.int8)
            shape = tuple(codes.shape)
        else:
            raise ArtifactError(
                f"{self.source}: {module}: compressed-tensors format {group.format!r} is not "
                "supported (pack-quantized, int-quantized, float-quantized, naive-quantized)"
            )
        rows = shape[0]
        scale = ckpt.get(f"{module}.weight_scale").to(torch.float32)
        scale = scale.reshape(rows, -1) if scale.numel() >= rows else scale.reshape(1, 1)
        scale = scale.expand(rows, -1).contiguous()
        zero = ckpt.maybe(f"{module}.weight_zero_point")
        if zero is not None:
            if group.format == "pack-quantized" and zero.dtype == torch.int32:
                zero = unpack(zero.t(), scheme.num_bits, rows).t()
            zero = zero.to(torch.int8).reshape(rows, -1).expand(rows, scale.shape[1])
            zero = None if not bool(zero.any()) else zero.contiguous()
        g_idx = ckpt.maybe(f"{module}.weight_g_idx")
        if g_idx is not None and torch.equal(
            g_idx.long(), torch.arange(shape[1]) // (shape[1] // scale.shape[1])
        ):
            g_idx = None
        input_scale = ckpt.maybe(f"{module}.input_scale")
        if input_scale is not None:
            input_scale = input_scale.to(torch.float32).reshape(())
        return LinearWeights(scheme, codes, scale, zero, g_idx, input_scale, bias)

    def kv_cache(self, ckpt: Checkpoint, config: ModelInfo) -> KVCacheSpec:
        """The KV-cache encoding: FP8 or INT8 codes with each layer's k/v scales."""
        scheme = self.kv_scheme
        if not scheme:
            return KVCacheSpec()
        kind = scheme.get("type", "float")
        bits = int(scheme.get("num_bits", 8))
        if bits != 8 or kind not in ("float", "int") or not scheme.get("symmetric", True):
            raise ArtifactError(
                f"{self.source}: kv_cache_scheme {scheme} is not supported "
                "(8-bit symmetric float or int)"
            )
        if scheme.get("dynamic"):
            raise ArtifactError(f"{self.source}: dynamic KV-cache scales are not supported")
        prefix = "model.layers.{}.self_attn"
        k = [ckpt.get(f"{prefix.format(i)}.k_scale") for i in range(config.num_layers)]
        v = [ckpt.get(f"{prefix.format(i)}.v_scale") for i in range(config.num_layers)]
        return KVCacheSpec("fp8" if kind == "float" else "int8", k, v)


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
