"""Quantised tiny checkpoints, made once per session and shared by the quant tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kiln.quant.quantize import quantize
from kiln.quant.schemes import resolve
from kiln.quant.spec import CalibrationSpec, QuantSpec

CALIBRATION = CalibrationSpec(dataset="builtin:licenses", num_samples=8, max_seq_len=64)
HELD_OUT = CalibrationSpec(dataset="builtin:licenses", num_samples=6, max_seq_len=96, seed=7)

# Every scheme with every backend that can produce it (KV cache modes folded in).
SPECS: dict[str, QuantSpec] = {
    "llmcompressor-fp8-kv_fp8": QuantSpec(
        method="fp8", weight_bits=8, activations="fp8_static", kv_cache="fp8"
    ),
    "llmcompressor-fp8_dynamic": QuantSpec(
        method="fp8_dynamic", weight_bits=8, activations="fp8_dynamic"
    ),
    "llmcompressor-awq-w4-g64-asym": QuantSpec(
        method="awq", weight_bits=4, group_size=64, symmetric=False
    ),
    "llmcompressor-gptq-w4-g64-kv_int8": QuantSpec(
        method="gptq", weight_bits=4, group_size=64, kv_cache="int8"
    ),
    "llmcompressor-gptq-w8": QuantSpec(method="gptq", weight_bits=8),
    "llmcompressor-smoothquant-dynamic": QuantSpec(
        method="smoothquant", weight_bits=8, activations="int8_dynamic"
    ),
    "llmcompressor-smoothquant-static": QuantSpec(
        method="smoothquant", weight_bits=8, activations="int8_static"
    ),
    "modelopt-fp8-kv_fp8": QuantSpec(
        method="fp8", weight_bits=8, activations="fp8_static", kv_cache="fp8", backend="modelopt"
    ),
    "modelopt-awq-w4-g64": QuantSpec(
        method="awq", weight_bits=4, group_size=64, backend="modelopt"
    ),
    "modelopt-smoothquant-static": QuantSpec(
        method="smoothquant", weight_bits=8, activations="int8_static", backend="modelopt"
    ),
    "modelopt-w4a8-awq-g64": QuantSpec(
        method="awq", weight_bits=4, group_size=64, activations="fp8_static", backend="modelopt"
    ),
}

Quantised = Callable[[str], tuple[Path, dict[str, Any]]]


@pytest.fixture(scope="session")
def quantised(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Quantised:
    """get(key) → (checkpoint dir, quantize() record) for SPECS[key], quantised once."""
    made: dict[str, tuple[Path, dict[str, Any]]] = {}

    def get(key: str) -> tuple[Path, dict[str, Any]]:
        if key not in made:
            out = tmp_path_factory.mktemp(key)
            made[key] = (out, quantize(tiny_llama, resolve(SPECS[key]), CALIBRATION, out))
        return made[key]

    return get


# The AWQ linears whose own pre_quant_scale ModelOpt's export keeps as calibrated (q/k/v and
# gate/up are re-smoothed with a shared scale on export and re-quantised).
KEPT_SCALES = ("model.layers.0.self_attn.o_proj", "model.layers.1.mlp.down_proj")


def export_modelopt_awq(
    model_dir: Path, key: str, calibration_ids: list[list[int]], out: Path
) -> dict[str, Any]:
    """Calibrate the float model at `model_dir` as SPECS[key] with ModelOpt and export it to
    `out`; returns ModelOpt's fake-quantised weights × pre_quant_scale of KEPT_SCALES."""
    import torch
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    from kiln.quant.backends.modelopt import calibrate
    from kiln.quant.schemes import resolve

    spec = SPECS[key]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    calibrate(model, resolve(spec), spec, calibration_ids)
    expected = {}
    with torch.no_grad():
        for name in KEPT_SCALES:
            linear = model.get_submodule(name)
            pqs = linear.input_quantizer.pre_quant_scale.flatten()
            expected[name] = linear.weight_quantizer(linear.weight) * pqs[None, :]
        export_hf_checkpoint(model, dtype=torch.float32, export_dir=out)
    return expected
