"""llm-compressor backend: `llmcompressor.oneshot` → compressed-tensors checkpoint.

Schemes map to compressed-tensors `QuantizationArgs` the way llm-compressor's own presets do
(FP8, FP8_DYNAMIC, W4A16, W8A16, INT8_W8A8), with group size, symmetry and KV cache taken
from the spec. AWQ is a transform in llm-compressor 0.14 (it only rescales), so it is
followed by a QuantizationModifier; SmoothQuant is followed by GPTQ.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kiln.quant.backends.base import QuantJob, register_backend
from kiln.quant.selection import ignore_regexes

if TYPE_CHECKING:
    from kiln.quant.spec import QuantSpec, Scheme


def _weights(scheme: Scheme) -> dict[str, Any]:
    if scheme.weight_type == "float":  # FP8: per tensor (static) or per channel (dynamic)
        strategy = "tensor" if scheme.name == "FP8" else "channel"
        return {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True}
    args: dict[str, Any] = {
        "num_bits": scheme.weight_bits,
        "type": "int",
        "symmetric": scheme.symmetric,
        "strategy": "channel" if scheme.group_size is None else "group",
    }
    if scheme.group_size is not None:
        args["group_size"] = scheme.group_size
    return args


def _eight_bit(
    kind: str, strategy: str, dynamic: bool, observer: str | None = None
) -> dict[str, Any]:
    """Symmetric 8-bit QuantizationArgs (as a dict) for activations or the KV cache."""
    args = {"num_bits": 8, "type": kind, "strategy": strategy, "dynamic": dynamic}
    return {**args, "symmetric": True, **({"observer": observer} if observer else {})}


# Static activation scales come from the min/max seen over all calibration batches.
ACTIVATIONS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "fp8_static": _eight_bit("float", "tensor", False, "static_minmax"),
    "fp8_dynamic": _eight_bit("float", "token", True),
    "int8_dynamic": _eight_bit("int", "token", True),
    "int8_static": _eight_bit("int", "tensor", False, "static_minmax"),
}
KV_CACHE: dict[str, dict[str, Any] | None] = {
    "none": None,
    "fp8": _eight_bit("float", "tensor", False),
    "int8": _eight_bit("int", "tensor", False),
}


def build_recipe(scheme: Scheme, spec: QuantSpec) -> list[Any]:
    """The llm-compressor modifiers that produce `scheme`."""
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.transform import AWQModifier, SmoothQuantModifier

    group: dict[str, Any] = {"targets": ["Linear"], "weights": _weights(scheme)}
    if ACTIVATIONS[scheme.activations] is not None:
        group["input_activations"] = ACTIVATIONS[scheme.activations]
    quant_args: dict[str, Any] = {
        "config_groups": {"group_0": group},
        "ignore": [f"re:{r}" for r in ignore_regexes(spec.ignore)],
        "kv_cache_scheme": KV_CACHE[scheme.kv_cache],
    }
    if scheme.method == "awq":
        return [AWQModifier(), QuantizationModifier(**quant_args)]
    if scheme.method == "gptq":
        return [GPTQModifier(dampening_frac=spec.dampening_frac, **quant_args)]
    if scheme.method == "smoothquant":
        return [
            SmoothQuantModifier(smoothing_strength=spec.smoothing_strength),
            GPTQModifier(dampening_frac=spec.dampening_frac, **quant_args),
        ]
    return [QuantizationModifier(**quant_args)]  # fp8, fp8_dynamic: round to nearest


@register_backend(
    "llmcompressor",
    format="compressed-tensors",
    schemes={"NO_QUANT", "FP8", "FP8_DYNAMIC", "W4A16_AWQ", "W4A16_GPTQ", "W8A16", "W8A8_SQ"},
    activations=set(ACTIVATIONS),
    kv_cache=set(KV_CACHE),
    asymmetric={"W4A16_AWQ", "W4A16_GPTQ", "W8A16"},
    per_channel={"W4A16_AWQ", "W4A16_GPTQ", "W8A16"},
    packages=("llmcompressor", "compressed-tensors"),
)
def run(job: QuantJob) -> None:
    """Quantise the model in place with oneshot and save it compressed into job.out_dir."""
    from datasets import Dataset
    from llmcompressor import oneshot

    from kiln.quant.backends.cpu_workarounds import llmcompressor_on_cpu

    samples = job.samples
    dataset = None
    if samples:
        dataset = Dataset.from_dict(
            {"input_ids": samples, "attention_mask": [[1] * len(s) for s in samples]}
        )
    with llmcompressor_on_cpu():
        oneshot(
            model=job.model,
            tokenizer=job.tokenizer,
            recipe=build_recipe(job.scheme, job.spec),
            dataset=dataset,
            num_calibration_samples=max(len(samples), 1),
            max_seq_length=max((len(s) for s in samples), default=None),
            shuffle_calibration_samples=False,
            moe_calibrate_all_experts=job.calibrate_all_experts,
        )
    job.progress(f"saving compressed-tensors checkpoint to {job.out_dir}")
    job.model.save_pretrained(job.out_dir, save_compressed=True)


def load_checkpoint(path: Path) -> tuple[Any, dict[str, Any]]:
    """(model, dequantised weights) of a compressed-tensors checkpoint, float32 on CPU.

    transformers decompresses the saved codes with compressed-tensors at load time; the
    model keeps compressed-tensors' activation and KV cache quantisation in its forward.
    """
    import torch
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True)
    )
    model.eval()
    weights = {
        name: module.weight.detach()
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear)
        and getattr(getattr(module, "quantization_scheme", None), "weights", None) is not None
    }
    return model, weights
