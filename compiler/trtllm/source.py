"""Read a quantised Hugging Face checkpoint into integer codes, scales and zero points.

Two formats come in: compressed-tensors (llm-compressor; `quantization_config.quant_method`
compressed-tensors) and ModelOpt's HF export (`hf_quant_config.json`); a checkpoint with
neither is a float model. Packed int4/int8 codes are unpacked with compressed-tensors' own
`unpack_from_int32`; ModelOpt's uint8 int4 packing (two output rows per byte, low nibble
first) has no public unpacker, so `unpack_int4_rows` here inverts it.

Everything is kept in the quantiser's own convention so nothing is lost before export:
`w = (code - zero) * scale` (compressed-tensors) and `y = (x * pre_quant_scale) @ w.T`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kiln.quant.schemes import is_ignored
from kiln.runtime.errors import SourceError, UsageError
from kiln.runtime.model_info import ModelInfo

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")


@dataclass(frozen=True)
class QLinear:
    """One linear as the quantiser stored it. `weight` is float, float8 or int8 codes (out, in);
    `scale` is () per tensor, (out,) per channel or (out, in/group) per group."""

    weight: torch.Tensor
    scale: torch.Tensor | None = None
    zero: torch.Tensor | None = None  # int8 zero points, shape of a grouped scale
    input_scale: torch.Tensor | None = None  # () static activation scale
    pre_quant_scale: torch.Tensor | None = None  # (in,) AWQ/SmoothQuant activation scale
    group_size: int | None = None  # set when `scale` is (out, in/group)

    def rows(self, index: torch.Tensor) -> QLinear:
        """The output channels `index` (per-tensor scales are kept whole)."""
        per_row = self.scale is not None and self.scale.ndim >= 1 and self.scale.numel() > 1
        return replace(
            self,
            weight=self.weight[index],
            scale=self.scale[index] if per_row and self.scale is not None else self.scale,
            zero=self.zero[index] if self.zero is not None else None,
        )

    def cols(self, start: int, end: int) -> QLinear:
        """The input channels start:end; grouped scales must split on a group boundary."""
        group, scale, zero = self.group_size, self.scale, self.zero
        if group is not None and scale is not None:
            if start % group or end % group:
                raise UsageError(
                    f"tensor parallel split at input channel {start}:{end} cuts a quantisation "
                    f"group of {group} — choose a tp_size that divides in_features / {group}"
                )
            scale = scale[:, start // group : end // group]
            zero = zero[:, start // group : end // group] if zero is not None else None
        pqs = self.pre_quant_scale
        return replace(
            self,
            weight=self.weight[:, start:end],
            scale=scale,
            zero=zero,
            pre_quant_scale=pqs[start:end] if pqs is not None else None,
        )

    def dequantize(self) -> torch.Tensor:
        """Float32 weight the linear computes with, activation pre-scaling folded in."""
        w = self.weight.to(torch.float32)
        if self.scale is not None:
            scale = self.scale.to(torch.float32)
            if self.group_size is not None:
                scale = scale.repeat_interleave(self.group_size, dim=1)
            elif scale.ndim == 1:
                scale = scale[:, None]
            if self.zero is not None:
                zero = self.zero.to(torch.float32)
                w = w - zero.repeat_interleave(w.shape[1] // zero.shape[1], dim=1)
            w = w * scale
        if self.pre_quant_scale is not None:
            w = w * self.pre_quant_scale.to(torch.float32)[None, :]
        return w


@dataclass
class Source:
    """A quantised checkpoint in memory: shapes, scheme, linears and the float rest."""

    config: dict[str, Any]
    info: ModelInfo
    quant_algo: str
    kv_cache_quant_algo: str | None
    symmetric: bool
    fmt: str  # compressed-tensors | modelopt | float
    linears: dict[str, QLinear] = field(default_factory=dict)  # HF module name → linear
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # embeddings, norms, lm_head
    kv_scales: dict[int, torch.Tensor] = field(default_factory=dict)  # layer → dequant scale


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """(out/2, in) bytes of two signed int4 output rows each → (out, in) int8 codes."""
    data = packed.view(torch.uint8).to(torch.int16)
    low, high = data & 0x0F, data >> 4
    codes = torch.stack([low, high], dim=1).reshape(-1, packed.shape[1])
    return torch.where(codes > 7, codes - 16, codes).to(torch.int8)


def pack_int4_rows(codes: torch.Tensor) -> torch.Tensor:
    """Inverse of unpack_int4_rows: (out, in) signed int4 codes → (out/2, in) int8 bytes."""
    pairs = (codes.to(torch.int16) & 0x0F).reshape(-1, 2, codes.shape[1])
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8).view(torch.int8)


def _load_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise SourceError(f"{model_dir}: no *.safetensors files — export needs safetensors")
    out: dict[str, torch.Tensor] = {}
    for path in files:
        with safe_open(str(path), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                out[key] = f.get_tensor(key)
    return out


def _ct_weights(qc: dict[str, Any]) -> dict[str, Any]:
    groups = list(qc["config_groups"].values())
    if len(groups) != 1:
        raise UsageError(
            "compressed-tensors checkpoints with several config_groups (mixed "
            "precision) have no single TensorRT-LLM quant_algo"
        )
    return dict(groups[0])


def _ct_algo(qc: dict[str, Any]) -> str:
    """The TensorRT-LLM QuantAlgo of a compressed-tensors config group."""
    group = _ct_weights(qc)
    w, a = group["weights"], group.get("input_activations") or {}
    grouped = w.get("strategy") == "group"
    if w.get("type") == "float":
        return "FP8" if w.get("strategy") == "tensor" else "FP8_PER_CHANNEL_PER_TOKEN"
    if a and a.get("type") == "int":
        return "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN" if a.get("dynamic") else "W8A8_SQ_PER_CHANNEL"
    if a and a.get("type") == "float":
        return "W4A8_AWQ"
    if int(w["num_bits"]) == 8:
        return "W8A16_GPTQ" if grouped else "W8A16"
    if not grouped:
        return "W4A16"
    return "W4A16_GPTQ" if w.get("actorder") else "W4A16_AWQ"  # GPTQ records its act order


def _compressed_tensors(raw: dict[str, torch.Tensor], qc: dict[str, Any], name: str) -> QLinear:
    from compressed_tensors.compressors.pack_quantized import unpack_from_int32

    weights = _ct_weights(qc)["weights"]
    bits, strategy = int(weights["num_bits"]), weights.get("strategy")
    scale = raw[f"{name}.weight_scale"].to(torch.float32)
    if f"{name}.weight_g_idx" in raw:
        raise UsageError(f"{name}: GPTQ activation reordering (g_idx) has no TensorRT-LLM layout")
    if f"{name}.weight_packed" in raw:
        shape = torch.Size(int(d) for d in raw[f"{name}.weight_shape"].tolist())
        codes = unpack_from_int32(raw[f"{name}.weight_packed"], bits, shape)
    else:
        codes = raw[f"{name}.weight"]
    zero = None
    if f"{name}.weight_zero_point" in raw:
        zp = raw[f"{name}.weight_zero_point"]
        zp_shape = torch.Size((codes.shape[0], scale.shape[-1]))
        zero = (
            unpack_from_int32(zp, bits, zp_shape, packed_dim=0)
            if zp.dtype == torch.int32
            else zp.to(torch.int8).reshape(zp_shape)
        )
    if strategy == "tensor":
        scale = scale.reshape(())
    elif strategy == "channel":
        scale = scale.reshape(-1)
        zero = zero.reshape(-1, 1) if zero is not None else None
    input_scale = raw.get(f"{name}.input_scale")
    return QLinear(
        codes,
        scale,
        zero,
        input_scale.reshape(()).to(torch.float32) if input_scale is not None else None,
        group_size=int(weights["group_size"]) if strategy == "group" else None,
    )


def _modelopt(raw: dict[str, torch.Tensor], name: str, group_size: int | None) -> QLinear:
    weight = raw[f"{name}.weight"]
    scale = raw[f"{name}.weight_scale"].to(torch.float32)
    if weight.dtype == torch.uint8:  # int4 AWQ: two output rows per byte
        weight = unpack_int4_rows(weight)
    else:
        group_size = None
        scale = scale.reshape(()) if scale.numel() == 1 else scale.reshape(-1)
    input_scale = raw.get(f"{name}.input_scale")
    pqs = raw.get(f"{name}.pre_quant_scale")
    return QLinear(
        weight,
        scale,
        None,
        input_scale.reshape(()).to(torch.float32) if input_scale is not None else None,
        pqs.to(torch.float32) if pqs is not None else None,
        group_size,
    )


def _kv_algo(kv: dict[str, Any] | None) -> str | None:
    if not kv:
        return None
    return "FP8" if kv.get("type") == "float" else "INT8"


def read_source(model_dir: Path, quant_algo: str | None = None) -> Source:
    """Load `model_dir` (compressed-tensors, ModelOpt HF export or float).

    `quant_algo` is the TensorRT-LLM algorithm the quantiser recorded (the manifest's
    `trtllm_quant_algo`); without it the algorithm is read off the checkpoint (W4A16 GPTQ
    and AWQ differ there only by GPTQ's recorded `actorder`).
    """
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    info = ModelInfo.from_hf_config(config)
    if info.architecture not in ARCHITECTURES:
        raise UsageError(
            f"{model_dir}: TensorRT-LLM export supports {', '.join(ARCHITECTURES)}, "
            f"not {info.architecture}"
        )
    raw = _load_tensors(model_dir)
    qc = config.get("quantization_config") or {}
    modelopt_cfg = model_dir / "hf_quant_config.json"
    names = [
        f"model.layers.{i}.{'self_attn' if p in LINEARS[:4] else 'mlp'}.{p}"
        for i in range(info.num_layers)
        for p in LINEARS
    ] + ["lm_head"]
    if qc.get("quant_method") == "compressed-tensors":
        fmt, ignore = "compressed-tensors", tuple(qc.get("ignore") or ())
        kv_algo = _kv_algo(qc.get("kv_cache_scheme"))
        symmetric = bool(_ct_weights(qc)["weights"].get("symmetric", True))
        quant_algo = quant_algo or _ct_algo(qc)
        read = lambda n: _compressed_tensors(raw, qc, n)  # noqa: E731
        kv_keys = ("self_attn.k_scale", "self_attn.v_scale")
    elif modelopt_cfg.is_file():
        mo = json.loads(modelopt_cfg.read_text())
        mo = mo.get("quantization", mo)
        fmt, ignore, symmetric = "modelopt", tuple(mo.get("exclude_modules") or ()), True
        kv_algo = mo.get("kv_cache_quant_algo")
        quant_algo = quant_algo or mo.get("quant_algo")
        group = mo.get("group_size")
        read = lambda n: _modelopt(raw, n, group)  # noqa: E731
        kv_keys = ("self_attn.k_proj.k_scale", "self_attn.v_proj.v_scale")
    else:
        fmt, ignore, symmetric, kv_algo, kv_keys = "float", tuple(names), True, None, ("", "")
        quant_algo = "NO_QUANT"
        read = lambda n: QLinear(raw[f"{n}.weight"])  # noqa: E731
    src = Source(config, info, str(quant_algo), kv_algo, symmetric, fmt)
    for name in names:
        if name == "lm_head" and f"{name}.weight" not in raw:
            continue  # tied to the embedding (SmolLM2, Qwen2-0.5B): filled in below
        quantised = not is_ignored(name, ignore) and f"{name}.weight_scale" in raw
        src.linears[name] = read(name) if quantised else QLinear(raw[f"{name}.weight"])
    if "lm_head" not in src.linears:
        src.linears["lm_head"] = QLinear(raw["model.embed_tokens.weight"])
    for key in ("model.embed_tokens.weight", "model.norm.weight"):
        src.tensors[key] = raw[key]
    for i in range(info.num_layers):
        for norm in ("input_layernorm", "post_attention_layernorm"):
            key = f"model.layers.{i}.{norm}.weight"
            src.tensors[key] = raw[key]
        if kv_algo is not None:
            k, v = (raw[f"model.layers.{i}.{suffix}"].to(torch.float32) for suffix in kv_keys)
            src.kv_scales[i] = torch.maximum(k.reshape(()), v.reshape(()))
    return src
