"""NVIDIA ModelOpt backend: `mtq.quantize(model, cfg, forward_loop)` → `export_hf_checkpoint`.

Starts from ModelOpt's own presets (FP8_DEFAULT_CFG, INT4_AWQ_CFG, INT8_SMOOTHQUANT_CFG,
W4A8_AWQ_BETA_CFG), sets the AWQ block size to the group size, adds FP8_KV_CFG for an FP8
KV cache, and appends a disabling entry for every linear the spec ignores. The export writes
`hf_quant_config.json` and a config.json whose quantization_config has quant_method
"modelopt"; unquantised tensors are exported in the dtype the model was loaded in.

What ships differs from the calibrated in-memory model in one ModelOpt-made way (see
modelopt/torch/export): AWQ's per-linear pre_quant_scales of q/k/v (and gate/up) are
unified, folded into the preceding norm and those weights re-quantised; o_proj and
down_proj keep their own scale and are tested to match the calibrated values exactly.
Reading back, fp8 rounding ties go to even as in torch's cast and the GPU's conversion;
ModelOpt's CPU emulation may round a tie the other way, a one-ulp difference on that value.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.quant.backends import QuantJob, register_backend
from kiln.quant.schemes import is_ignored

if TYPE_CHECKING:
    from kiln.quant.schemes import Scheme
    from kiln.quant.spec import QuantSpec

PRESETS = {
    "FP8": "FP8_DEFAULT_CFG",
    "W4A16_AWQ": "INT4_AWQ_CFG",
    "W8A8_SQ": "INT8_SMOOTHQUANT_CFG",
    "W4A8_AWQ": "W4A8_AWQ_BETA_CFG",
}


def build_config(model: Any, scheme: Scheme, spec: QuantSpec) -> dict[str, Any]:
    """The mtq.quantize config for `scheme`, from ModelOpt's preset."""
    import modelopt.torch.quantization as mtq
    import torch

    cfg = copy.deepcopy(getattr(mtq, PRESETS[scheme.name]))
    if scheme.group_size is not None:
        for entry in cfg["quant_cfg"]:
            if entry.get("quantizer_name") != "*weight_quantizer":
                continue
            for args in entry["cfg"] if isinstance(entry["cfg"], list) else [entry["cfg"]]:
                if args.get("block_sizes"):
                    args["block_sizes"][-1] = scheme.group_size
    if scheme.kv_cache == "fp8":
        cfg["quant_cfg"] += copy.deepcopy(mtq.FP8_KV_CFG["quant_cfg"])
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and is_ignored(name, spec.ignore):
            cfg["quant_cfg"].append({"quantizer_name": f"{name}.*", "enable": False})
    return cfg


def calibrate(model: Any, scheme: Scheme, spec: QuantSpec, samples: list[list[int]]) -> None:
    """Insert ModelOpt quantisers into `model` and calibrate them on `samples` (in place)."""
    import modelopt.torch.quantization as mtq
    import torch

    def forward_loop(m: torch.nn.Module) -> None:
        for ids in samples:
            m(torch.tensor([ids]))

    mtq.quantize(model, build_config(model, scheme, spec), forward_loop)


@register_backend(
    "modelopt",
    format="modelopt",
    schemes={"NO_QUANT", *PRESETS},
    activations={"none", "fp8_static", "int8_static"},
    kv_cache={"none", "fp8"},
    packages=("nvidia-modelopt",),
)
def run(job: QuantJob) -> None:
    """Calibrate the model with ModelOpt and export the HF checkpoint into job.out_dir.

    The export rewrites the model's weights into their packed form: the model cannot run after.
    """
    from modelopt.torch.export import export_hf_checkpoint

    calibrate(job.model, job.scheme, job.spec, job.samples)
    job.progress(f"exporting ModelOpt HF checkpoint to {job.out_dir}")
    export_hf_checkpoint(job.model, dtype=job.model.dtype, export_dir=job.out_dir)


# Reading the export back. transformers has no "modelopt" quantizer, so a ModelOpt HF
# checkpoint cannot be loaded by from_pretrained (on CPU or anywhere). We rebuild the float
# model from the exported integer/fp8 codes and scales, following modelopt/torch/export:
#   fp8 weight:   W = weight.float() * weight_scale        (scalar, or per output row)
#   int8 weight:  W = weight.float() * weight_scale[:, None]
#   int4 weight:  uint8 [out/2, in]; byte (r, c) holds rows 2r (low nibble) and 2r+1 (high
#                 nibble) of column c as signed 4-bit codes; W = code * weight_scale[:, c // block]
#   pre_quant_scale (AWQ, SmoothQuant): the input is multiplied by it before the linear;
#   input_scale: static per-tensor activation scale (fp8 or int8, by the weight's type);
#   k_proj.k_scale / v_proj.v_scale: per-tensor KV cache scales.


def fake_quant_fp8(x: Any, scale: Any) -> Any:
    """Round x to float8_e4m3fn with a per-tensor scale and back."""
    import torch

    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype) * scale


def fake_quant_int8(x: Any, scale: Any) -> Any:
    """Round x to int8 with a per-tensor scale and back."""
    return (x / scale).round().clamp(-128, 127) * scale


def unpack_int4(packed: Any) -> Any:
    """ModelOpt's uint8 [out/2, in] packing → signed int4 codes [out, in] (as int8)."""
    import torch

    low = (packed & 0x0F).to(torch.int8)
    high = (packed >> 4).to(torch.int8)
    codes = torch.stack([low, high], dim=1).reshape(-1, packed.shape[1])
    return torch.where(codes >= 8, codes - 16, codes)


def dequantize_weight(weight: Any, scale: Any) -> Any:
    """A linear's float weight from its exported codes and scale."""
    import torch

    if weight.dtype == torch.uint8:
        codes = unpack_int4(weight).float()
        block = codes.shape[1] // scale.shape[-1]
        return codes * scale.float().repeat_interleave(block, dim=-1)
    scale = scale.float()
    if scale.dim() == 1:
        scale = scale[:, None]
    return weight.float() * scale


def _read_tensors(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    tensors: dict[str, Any] = {}
    for shard in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def load_checkpoint(path: Path) -> tuple[Any, dict[str, Any]]:
    """(model, effective weights) of a ModelOpt HF export, in float32 on CPU.

    The model computes with the dequantised weights and applies the exported activation
    scales (pre_quant_scale, then fake quantisation of the input: int8 for SmoothQuant, fp8
    otherwise) and KV cache scales (keys and values rounded after RoPE, as the cache holds
    them). W4A8's per-tensor `weight_scale_2` is not applied: it only re-expresses the int4
    codes in fp8 for the kernel. Effective weights are dequantised weight × pre_quant_scale
    per input column, comparable with the float model's.
    """
    import json

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    quant = json.loads((path / "hf_quant_config.json").read_text())["quantization"]
    act_fq = (
        fake_quant_int8 if str(quant.get("quant_algo")).startswith("W8A8_SQ") else fake_quant_fp8
    )
    kv_fq = fake_quant_int8 if quant.get("kv_cache_quant_algo") == "INT8" else fake_quant_fp8
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    tensors = _read_tensors(path)
    state: dict[str, Any] = {}
    effective: dict[str, Any] = {}
    extras: dict[str, dict[str, Any]] = {}
    for key, value in tensors.items():
        prefix, _, leaf = key.rpartition(".")
        if leaf == "weight" and f"{prefix}.weight_scale" in tensors:
            weight = dequantize_weight(value, tensors[f"{prefix}.weight_scale"])
            state[key] = weight
            pqs = tensors.get(f"{prefix}.pre_quant_scale")
            effective[prefix] = weight * pqs.float()[None, :] if pqs is not None else weight
        elif leaf in SCALES:
            extras.setdefault(prefix, {})[leaf] = value.float()
        else:
            state[key] = value.float() if value.is_floating_point() else value
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if config.tie_word_embeddings:
        missing = [k for k in missing if k != "lm_head.weight"]
        model.tie_weights()
    if missing or unexpected:
        raise ValueError(
            f"{path}: tensors do not fit {config.architectures}: "
            f"missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    modules = dict(model.named_modules())
    kv_scales: dict[str, Any] = {}
    for prefix, found in extras.items():
        if "pre_quant_scale" in found or "input_scale" in found:
            modules[prefix].register_forward_pre_hook(
                _input_hook(found.get("pre_quant_scale"), found.get("input_scale"), act_fq)
            )
        for leaf in ("k_scale", "v_scale"):
            if leaf in found:  # stored on k_proj / v_proj; the attention module holds the cache
                kv_scales[f"{prefix.rpartition('.')[0]}.{leaf}"] = found[leaf]
    if kv_scales:
        _quantised_kv_attention(model, kv_scales, kv_fq)
    model.eval()
    return model, effective


SCALES = ("weight_scale", "weight_scale_2", "input_scale", "pre_quant_scale", "k_scale", "v_scale")


def _input_hook(pqs: Any, scale: Any, fake_quant: Callable[[Any, Any], Any]) -> Any:
    def hook(module: Any, args: tuple[Any, ...]) -> tuple[Any, ...]:
        x = args[0]
        if pqs is not None:
            x = x * pqs
        if scale is not None:
            x = fake_quant(x, scale)
        return (x, *args[1:])

    return hook


KV_ATTENTION = "kiln_quantised_kv"


def _quantised_kv_attention(
    model: Any, scales: dict[str, Any], fake_quant: Callable[[Any, Any], Any]
) -> None:
    """Route attention through SDPA with keys and values rounded as the KV cache holds them."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def attention(module: Any, query: Any, key: Any, value: Any, *args: Any, **kwargs: Any) -> Any:
        k_scale, v_scale = getattr(module, "kiln_kv_scales", (None, None))
        if k_scale is not None:
            key = fake_quant(key, k_scale)
        if v_scale is not None:
            value = fake_quant(value, v_scale)
        return sdpa_attention_forward(module, query, key, value, *args, **kwargs)

    AttentionInterface.register(KV_ATTENTION, attention)
    for name, module in model.named_modules():
        if f"{name}.k_scale" in scales or f"{name}.v_scale" in scales:
            module.kiln_kv_scales = (scales.get(f"{name}.k_scale"), scales.get(f"{name}.v_scale"))
    model.set_attn_implementation(KV_ATTENTION)
