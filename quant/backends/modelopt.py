"""NVIDIA ModelOpt backend: `mtq.quantize(model, cfg, forward_loop)` → `export_hf_checkpoint`.

Starts from ModelOpt's own presets (FP8_DEFAULT_CFG, INT4_AWQ_CFG, INT8_SMOOTHQUANT_CFG,
W4A8_AWQ_BETA_CFG, NVFP4_DEFAULT_CFG), sets the AWQ block size to the group size, adds
FP8_KV_CFG for an FP8 KV cache, and appends a disabling entry for every linear the spec
ignores. The export writes `hf_quant_config.json` and a config.json whose
quantization_config has quant_method "modelopt"; unquantised tensors are exported in the
dtype the model was loaded in.

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

from kiln.quant.backends.base import QuantJob, register_backend
from kiln.quant.selection import is_ignored

if TYPE_CHECKING:
    from kiln.quant.spec import QuantSpec, Scheme

PRESETS = {
    "FP8": "FP8_DEFAULT_CFG",
    "W4A16_AWQ": "INT4_AWQ_CFG",
    "W8A8_SQ": "INT8_SMOOTHQUANT_CFG",
    "W4A8_AWQ": "W4A8_AWQ_BETA_CFG",
    # Calibrates on a CPU (max amax collection) and exports there, but ModelOpt's NVFP4 fake
    # quantiser asserts a CUDA tensor, so the calibrated model cannot run on a CPU: the
    # export is read back and run with kiln's own NVFP4 emulation (runtime/formats/nvfp4.py).
    "NVFP4": "NVFP4_DEFAULT_CFG",
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
    activations={"none", "fp8_static", "int8_static", "nvfp4"},
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
# model from the exported codes and scales as the runtime's checkpoint reader decodes them
# (kiln.runtime.formats.checkpoint, which documents the format), and apply the activation and KV
# cache scales it reports with hooks.


def fake_quant_fp8(x: Any, scale: Any) -> Any:
    """Round x to float8_e4m3fn with a per-tensor scale and back."""
    import torch

    return (x / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).to(x.dtype) * scale


def fake_quant_int8(x: Any, scale: Any) -> Any:
    """Round x to int8 with a per-tensor scale and back."""
    return (x / scale).round().clamp(-128, 127) * scale


def load_checkpoint(path: Path) -> tuple[Any, dict[str, Any]]:
    """(model, effective weights) of a ModelOpt HF export, in float32 on CPU.

    The model computes with the dequantised weights as the deployed kernel holds them
    (`served_linear`: W4A8 AWQ's FP8-rounded weights) and applies the exported activation
    scales (pre_quant_scale, then fake quantisation of the input: int8 for SmoothQuant, fp8
    otherwise) and KV cache scales (keys and values rounded after RoPE, as the cache holds
    them). Effective weights are dequantised weight × pre_quant_scale per input column,
    comparable with the float model's.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kiln.runtime.formats import nvfp4
    from kiln.runtime.formats.checkpoint import open_checkpoint
    from kiln.runtime.formats.model_info import ModelInfo
    from kiln.runtime.formats.weights import LinearWeights, dequantize, effective_weight

    ckpt = open_checkpoint(Path(path))
    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    state: dict[str, Any] = {}
    effective: dict[str, Any] = {}
    quantised: dict[str, LinearWeights] = {}
    for key in ckpt.names():
        prefix, _, leaf = key.rpartition(".")
        if ckpt.is_quantised(prefix):  # its scales are decoded with its weight
            if leaf == "weight":
                quantised[prefix] = linear = ckpt.served_linear(prefix)
                state[f"{prefix}.weight"] = dequantize(linear, torch.float32)
                if linear.bias is not None:
                    state[f"{prefix}.bias"] = linear.bias.float()
                effective[prefix] = effective_weight(linear, torch.float32)
            continue
        value = ckpt.tensor(key)
        state[key] = value.float() if value.is_floating_point() else value
    if ModelInfo.from_hf_config(ckpt.config).moe is not None:
        model = _load_experts(config, state)
        # transformers fuses each layer's experts into one module of 3-D tensors: the report
        # compares and fake-quantises the linears that stay linears (as for llm-compressor's
        # checkpoints, which transformers loads the same way).
        quantised = {p: w for p, w in quantised.items() if ".experts." not in p}
        effective = {p: w for p, w in effective.items() if ".experts." not in p}
        state = model.state_dict()
    else:
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
    for prefix, linear in quantised.items():
        acts = linear.scheme.activations
        if linear.pre_quant_scale is not None or linear.input_scale is not None:
            fake_quant = (
                fake_quant_int8
                if acts is not None and acts.type == "int"
                else nvfp4.fake_quantize
                if acts is not None and acts.num_bits == 4
                else fake_quant_fp8
            )
            model.get_submodule(prefix).register_forward_pre_hook(
                _input_hook(linear.pre_quant_scale, linear.input_scale, fake_quant)
            )
    if ckpt.kv_cache is not None:
        kv_scales: dict[str, Any] = {}
        for layer in range(config.num_hidden_layers):
            k, v = ckpt.kv_scales(layer)
            kv_scales[f"model.layers.{layer}.self_attn.k_scale"] = k.float()
            kv_scales[f"model.layers.{layer}.self_attn.v_scale"] = v.float()
        kv_fq = fake_quant_int8 if ckpt.kv_cache == "int8" else fake_quant_fp8
        _quantised_kv_attention(model, kv_scales, kv_fq)
    model.eval()
    return model, effective


def _load_experts(config: Any, state: dict[str, Any]) -> Any:
    """A mixture-of-experts model from `state` under its checkpoint names (each expert's
    linears apart, as ModelOpt exports them): written out and read back by transformers,
    whose checkpoint conversion fuses the experts as its model holds them."""
    import tempfile

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    with tempfile.TemporaryDirectory(prefix="kiln-moe-") as tmp:
        config.save_pretrained(tmp)
        tensors = {k: v.contiguous() for k, v in state.items() if k != "lm_head.weight"
                   or not config.tie_word_embeddings}  # fmt: skip
        save_file(tensors, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32)


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
