"""Tiny AutoAWQ and AutoGPTQ / GPTQModel checkpoints, written from a float tiny model.

Weights are quantised with plain round-to-nearest the way the libraries' own packers compute
codes: fp16 scales first, then q = clamp(round(w / s) + z, 0, 2^b − 1). Packing follows the
libraries field by field (AutoAWQ `WQLinear_GEMM.from_linear`, AutoGPTQ `QuantLinear.pack`,
GPTQModel's v2 zero points), and config.json carries the `quantization_config` each library
writes. The float parts (embeddings, norms, lm_head) are stored in fp16, as published
checkpoints are. Each builder returns the reference dequantisation (q − z) × s in float32.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
LINEARS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


@dataclass
class PreQuantizedCheckpoint:
    """A written checkpoint and the float32 weights it stands for."""

    path: Path
    reference: dict[str, torch.Tensor] = field(default_factory=dict)  # module → (out, in)
    floats: dict[str, torch.Tensor] = field(default_factory=dict)  # float tensors, fp16


def linear_names(num_layers: int) -> list[str]:
    return [
        f"model.layers.{i}.{block}.{proj}"
        for i in range(num_layers)
        for block, projs in LINEARS.items()
        for proj in projs
    ]


def round_to_nearest(
    w: torch.Tensor, bits: int, group_size: int | None, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q (out, in), z (out, groups), s fp16 (out, groups)) for a float weight (out, in)."""
    out, width = w.shape
    group = group_size or width
    grouped = w.float().reshape(out, width // group, group)
    maxq = 2**bits - 1
    if symmetric:  # AutoGPTQ: the zero sits mid-range, the scale spans ±max|w|
        scale = (2 * grouped.abs().amax(-1) / maxq).clamp_min(1e-5).half()
        zero = torch.full(scale.shape, (maxq + 1) // 2, dtype=torch.int64)
    else:  # AutoAWQ / AutoGPTQ asymmetric: min..max onto 0..maxq
        top, bottom = grouped.amax(-1).clamp_min(0), grouped.amin(-1).clamp_max(0)
        scale = ((top - bottom) / maxq).clamp_min(1e-5).half()
        zero = torch.round(-bottom / scale.float()).clamp(0, maxq).to(torch.int64)
    codes = torch.round(grouped / scale.float()[..., None]) + zero[..., None]
    codes = codes.clamp(0, maxq).to(torch.int64).reshape(out, width)
    return codes, zero, scale


def dequantize(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """(q − z) × s in float32, groups laid along the input."""
    group = q.shape[1] // s.shape[1]
    zeros = z.repeat_interleave(group, dim=1)
    return (q - zeros).float() * s.float().repeat_interleave(group, dim=1)


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 → the int32 tensors the libraries store."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_awq(values: torch.Tensor) -> torch.Tensor:
    """AutoAWQ GEMM: 8 columns per word, field i holding column AWQ_ORDER[i] of its eight."""
    words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
    for i, column in enumerate(AWQ_ORDER):
        words |= values[:, column::8] << (4 * i)
    return to_int32(words)


def pack_gptq_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ qweight: 32/bits consecutive rows per word, lowest field first."""
    per = 32 // bits
    words = torch.zeros(values.shape[0] // per, values.shape[1], dtype=torch.int64)
    for i in range(per):
        words |= values[i::per] << (bits * i)
    return to_int32(words)


def pack_gptq_columns(values: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ qzeros: 32/bits consecutive columns per word, lowest field first."""
    return pack_gptq_rows(values.t().contiguous(), bits).t().contiguous()


def _float_parts(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors = load_file(str(model_dir / "model.safetensors"))
    return {k: v.half() for k, v in tensors.items()}


def _write(
    model_dir: Path,
    out: Path,
    tensors: dict[str, torch.Tensor],
    quantization_config: dict[str, Any],
    shards: int,
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((model_dir / "config.json").read_text())
    config.pop("dtype", None)
    config["torch_dtype"] = "float16"  # as published AWQ/GPTQ checkpoints say
    config["quantization_config"] = quantization_config
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in (*TOKENIZER_FILES, "generation_config.json"):
        if (model_dir / name).is_file():
            shutil.copy2(model_dir / name, out / name)
    keys = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return
    # Split the sorted keys evenly: a linear's qweight, qzeros and scales can land in
    # different shards, as Hugging Face's size-based sharding also allows.
    weight_map: dict[str, str] = {}
    step = -(-len(keys) // shards)
    for index in range(shards):
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: tensors[k] for k in keys[index * step : (index + 1) * step]}
        save_file(part, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    index_file = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=2))


def make_awq_checkpoint(
    model_dir: Path, out: Path, group_size: int | None = 64, shards: int = 1
) -> PreQuantizedCheckpoint:
    """An AutoAWQ GEMM checkpoint (4-bit, zero points) of the float model in `model_dir`."""
    tensors = _float_parts(model_dir)
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    made = PreQuantizedCheckpoint(out)
    for name in linear_names(num_layers):
        weight = tensors.pop(f"{name}.weight").float()
        q, z, s = round_to_nearest(weight, 4, group_size, symmetric=False)
        made.reference[name] = dequantize(q, z, s)
        tensors[f"{name}.qweight"] = pack_awq(q.t().contiguous())  # (in, out/8)
        tensors[f"{name}.qzeros"] = pack_awq(z.t().contiguous())  # (in/g, out/8)
        tensors[f"{name}.scales"] = s.t().contiguous()  # (in/g, out) fp16
    made.floats = {k: v for k, v in tensors.items() if k.endswith(".weight")}
    config = {  # AutoAWQ's AwqConfig as transformers saves it
        "quant_method": "awq",
        "bits": 4,
        "group_size": group_size or -1,
        "zero_point": True,
        "version": "gemm",
        "modules_to_not_convert": None,
    }
    _write(model_dir, out, tensors, config, shards)
    return made


def make_gptq_checkpoint(
    model_dir: Path,
    out: Path,
    *,
    bits: int = 4,
    group_size: int | None = 64,
    sym: bool = True,
    checkpoint_format: str = "gptq",
    producer: str = "autogptq",
    shards: int = 1,
) -> PreQuantizedCheckpoint:
    """An AutoGPTQ (`gptq`, zero − 1 stored) or GPTQModel (`gptq_v2`) checkpoint."""
    tensors = _float_parts(model_dir)
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    made = PreQuantizedCheckpoint(out)
    for name in linear_names(num_layers):
        weight = tensors.pop(f"{name}.weight").float()
        q, z, s = round_to_nearest(weight, bits, group_size, symmetric=sym)
        if checkpoint_format == "gptq":
            # v1 stores zero − 1; GPTQModel clamps a zero of 0 to 1 before storing, so the
            # checkpoint stands for zero max(z, 1)
            z = z.clamp_min(1)
            stored = z - 1
        else:
            stored = z
        made.reference[name] = dequantize(q, z, s)
        width = q.shape[1]
        tensors[f"{name}.qweight"] = pack_gptq_rows(q.t().contiguous(), bits)  # (in·b/32, out)
        tensors[f"{name}.qzeros"] = pack_gptq_columns(stored.t().contiguous(), bits)
        tensors[f"{name}.scales"] = s.t().contiguous()  # (in/g, out) fp16
        tensors[f"{name}.g_idx"] = (torch.arange(width) // (group_size or width)).to(torch.int32)
    made.floats = {k: v for k, v in tensors.items() if k.endswith(".weight")}
    config: dict[str, Any] = {
        "bits": bits,
        "group_size": group_size or -1,
        "desc_act": False,
        "sym": sym,
        "quant_method": "gptq",
        "checkpoint_format": checkpoint_format,
    }
    if producer == "gptqmodel":  # GPTQModel's QuantizeConfig.to_dict keys
        config |= {
            "format": checkpoint_format,
            "lm_head": False,
            "pack_dtype": "int32",
            "meta": {"quantizer": ["gptqmodel:7.6.0"], "static_groups": False},
        }
    else:  # AutoGPTQ's BaseQuantizeConfig.to_dict keys
        config |= {
            "damp_percent": 0.01,
            "static_groups": False,
            "true_sequential": True,
            "model_name_or_path": None,
            "model_file_base_name": "model",
        }
    _write(model_dir, out, tensors, config, shards)
    return made


def reference_model(model_dir: Path, made: PreQuantizedCheckpoint) -> Any:
    """The float32 model whose weights are the checkpoint's dequantised values."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = {name + ".weight": w for name, w in made.reference.items()}
    state |= {k: v.float() for k, v in made.floats.items()}
    missing = set(state) - set(model.state_dict())
    assert not missing, missing
    model.load_state_dict(state, strict=False)
    return model.eval()
