"""Scheme resolution and the checks that refuse a spec before anything loads."""

from __future__ import annotations

import pytest

from kiln.quant.memory import estimate_calibration_bytes
from kiln.quant.schemes import Problem, check, resolve
from kiln.quant.selection import quantised_linears
from kiln.quant.spec import CalibrationSpec, QuantSpec
from kiln.runtime.base.errors import PreflightError
from kiln.runtime.formats.model_info import ModelInfo

# SmolLM2-135M's config.json, the fields ModelInfo reads.
SMOLLM2 = ModelInfo.from_hf_config(
    {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "num_hidden_layers": 30,
        "vocab_size": 49152,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
    }
)


def _keys(problems: list[Problem]) -> list[str]:
    return [p.key for p in problems]


@pytest.mark.parametrize(
    ("spec", "name", "trtllm"),
    [
        (QuantSpec(), "NO_QUANT", "NO_QUANT"),
        (QuantSpec(method="fp8", weight_bits=8, activations="fp8_static"), "FP8", "FP8"),
        (
            QuantSpec(method="fp8_dynamic", weight_bits=8, activations="fp8_dynamic"),
            "FP8_DYNAMIC",
            "FP8_PER_CHANNEL_PER_TOKEN",
        ),
        (
            QuantSpec(method="fp8", weight_bits=8, activations="fp8_dynamic"),
            "FP8_DYNAMIC",
            "FP8_PER_CHANNEL_PER_TOKEN",
        ),
        (QuantSpec(method="awq", weight_bits=4, group_size=128), "W4A16_AWQ", "W4A16_AWQ"),
        (
            QuantSpec(
                method="awq",
                weight_bits=4,
                group_size=128,
                activations="fp8_static",
                backend="modelopt",
            ),
            "W4A8_AWQ",
            "W4A8_AWQ",
        ),
        (QuantSpec(method="gptq", weight_bits=4, group_size=64), "W4A16_GPTQ", "W4A16_GPTQ"),
        (QuantSpec(method="gptq", weight_bits=4), "W4A16_GPTQ", "W4A16"),
        (QuantSpec(method="gptq", weight_bits=8), "W8A16", "W8A16"),
        (QuantSpec(method="gptq", weight_bits=8, group_size=128), "W8A16", "W8A16_GPTQ"),
        (
            QuantSpec(method="smoothquant", weight_bits=8, activations="int8_dynamic"),
            "W8A8_SQ",
            "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN",
        ),
        (
            QuantSpec(method="smoothquant", weight_bits=8, activations="int8_static"),
            "W8A8_SQ",
            "W8A8_SQ_PER_CHANNEL",
        ),
    ],
)
def test_spec_resolves_to_the_tensorrt_llm_name(spec: QuantSpec, name: str, trtllm: str) -> None:
    scheme = resolve(spec)
    assert (scheme.name, scheme.trtllm_quant_algo) == (name, trtllm)
    assert check(spec, SMOLLM2 if spec.group_size != 128 else None) == []


def test_kv_cache_mode_is_part_of_the_scheme() -> None:
    scheme = resolve(
        QuantSpec(method="fp8", weight_bits=8, activations="fp8_static", kv_cache="fp8")
    )
    assert scheme.trtllm_kv_cache_quant_algo == "FP8"
    assert scheme.label == "FP8+KV_FP8"
    assert (
        resolve(
            QuantSpec(method="fp8_dynamic", weight_bits=8, activations="fp8_dynamic")
        ).needs_calibration
        is False
    )
    assert (
        resolve(
            QuantSpec(
                method="fp8_dynamic", weight_bits=8, activations="fp8_dynamic", kv_cache="int8"
            )
        ).needs_calibration
        is True
    )


def test_group_128_is_refused_for_hidden_576_with_what_works() -> None:
    problems = check(QuantSpec(method="gptq", weight_bits=4, group_size=128), SMOLLM2)
    assert _keys(problems) == ["quantization.group_size"]
    assert "576 is not divisible by 128 — use 64 or 32" in problems[0].problem
    assert problems[0].allowed == "64, 32"
    assert check(QuantSpec(method="gptq", weight_bits=4, group_size=64), SMOLLM2) == []


def test_group_size_is_checked_only_against_quantised_linears() -> None:
    info = ModelInfo.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 256,
            "intermediate_size": 320,
            "num_attention_heads": 4,
            "num_hidden_layers": 2,
            "vocab_size": 512,
        }
    )
    spec = QuantSpec(method="awq", weight_bits=4, group_size=128)
    [problem] = check(spec, info)
    assert "320 is not divisible by 128 — use 64 or 32" in problem.problem
    assert "down_proj" in problem.problem
    ignoring = QuantSpec(
        method="awq", weight_bits=4, group_size=128, ignore=("lm_head", "down_proj")
    )
    assert check(ignoring, info) == []
    assert not any(n.endswith("down_proj") for n in quantised_linears(info, ignoring.ignore))


def test_group_size_with_no_working_divisor_suggests_per_channel() -> None:
    info = ModelInfo.from_hf_config(
        {
            "architectures": ["LlamaForCausalLM"],
            "hidden_size": 200,
            "intermediate_size": 400,
            "num_attention_heads": 4,
            "num_hidden_layers": 1,
            "vocab_size": 512,
        }
    )
    [problem] = check(QuantSpec(method="gptq", weight_bits=4, group_size=64), info)
    assert "group_size: null" in problem.problem


def test_architecture_independent_checks_work_without_model_info() -> None:
    assert check(QuantSpec(method="gptq", weight_bits=4, group_size=128), None) == []
    assert _keys(check(QuantSpec(method="gptq", weight_bits=4, group_size=100), None)) == [
        "quantization.group_size"
    ]


@pytest.mark.parametrize(
    ("spec", "key", "says"),
    [
        (QuantSpec(method="awq", weight_bits=8), "quantization.weight_bits", "4"),
        (QuantSpec(method="gptq", weight_bits=3), "quantization.weight_bits", "4 or 8"),
        (
            QuantSpec(method="fp8", weight_bits=4, activations="fp8_static"),
            "quantization.weight_bits",
            "8",
        ),
        (
            QuantSpec(method="smoothquant", weight_bits=8, activations="fp8_dynamic"),
            "quantization.activations",
            "int8_dynamic, int8_static",
        ),
        (
            QuantSpec(method="gptq", weight_bits=4, activations="int8_dynamic"),
            "quantization.activations",
            "none",
        ),
        (
            QuantSpec(method="fp8", weight_bits=8, activations="fp8_static", group_size=128),
            "quantization.group_size",
            "null",
        ),
        (
            QuantSpec(
                method="smoothquant", weight_bits=8, activations="int8_dynamic", symmetric=False
            ),
            "quantization.symmetric",
            "true",
        ),
        (QuantSpec(kv_cache="fp8"), "quantization.kv_cache", "none"),
        (
            QuantSpec(method="gptq", weight_bits=4, backend="tensorrt"),
            "quantization.backend",
            "llmcompressor, modelopt",
        ),
    ],
)
def test_inconsistent_specs_are_refused(spec: QuantSpec, key: str, says: str) -> None:
    problems = check(spec)
    assert key in _keys(problems)
    assert says in next(p for p in problems if p.key == key).allowed


def test_resolve_refuses_what_check_refuses() -> None:
    with pytest.raises(
        PreflightError, match=r"quantization\.weight_bits: awq does not quantise weights to 8"
    ):
        resolve(QuantSpec(method="awq", weight_bits=8))


def test_backend_refusal_names_what_the_backend_can_do_and_who_can() -> None:
    [problem] = check(QuantSpec(method="gptq", weight_bits=4, group_size=64, backend="modelopt"))
    assert problem.key == "quantization.backend"
    assert "llmcompressor can do W4A16_GPTQ" in problem.problem
    assert problem.allowed == "modelopt does FP8, NO_QUANT, NVFP4, W4A16_AWQ, W4A8_AWQ, W8A8_SQ"
    [problem] = check(
        QuantSpec(method="awq", weight_bits=4, group_size=64, activations="fp8_static")
    )
    assert "llmcompressor cannot produce W4A8_AWQ; modelopt can do W4A8_AWQ" in problem.problem


@pytest.mark.parametrize(
    ("spec", "key"),
    [
        (
            QuantSpec(
                method="fp8_dynamic", weight_bits=8, activations="fp8_dynamic", backend="modelopt"
            ),
            "quantization.backend",
        ),
        (
            QuantSpec(
                method="smoothquant", weight_bits=8, activations="int8_dynamic", backend="modelopt"
            ),
            "quantization.activations",
        ),
        (
            QuantSpec(
                method="fp8",
                weight_bits=8,
                activations="fp8_static",
                kv_cache="int8",
                backend="modelopt",
            ),
            "quantization.kv_cache",
        ),
        (
            QuantSpec(
                method="awq", weight_bits=4, group_size=64, symmetric=False, backend="modelopt"
            ),
            "quantization.symmetric",
        ),
        (QuantSpec(method="awq", weight_bits=4, backend="modelopt"), "quantization.group_size"),
    ],
)
def test_modelopt_refuses_what_it_lacks(spec: QuantSpec, key: str) -> None:
    assert _keys(check(spec)) == [key]


def test_memory_estimate_for_smollm2_gptq() -> None:
    spec = QuantSpec(method="gptq", weight_bits=4, group_size=64)
    calib = CalibrationSpec(num_samples=64, max_seq_len=256)
    parts = estimate_calibration_bytes(SMOLLM2, resolve(spec), calib)
    assert parts["total"] == sum(v for k, v in parts.items() if k != "total")
    assert 530e6 < parts["weights"] < 560e6  # 134.5M parameters in fp32, plus scratch
    assert parts["hessians"] == (6 * 576**2 + 1536**2) * 4
    assert parts["awq"] == 0
    awq = estimate_calibration_bytes(
        SMOLLM2, resolve(QuantSpec(method="awq", weight_bits=4, group_size=64)), calib
    )
    assert awq["awq"] > 0 and awq["hessians"] == 0
    dynamic = estimate_calibration_bytes(
        SMOLLM2,
        resolve(QuantSpec(method="fp8_dynamic", weight_bits=8, activations="fp8_dynamic")),
        calib,
    )
    assert dynamic["activations"] == 0  # no calibration pass at all
    assert 1.0e9 < parts["total"] < 1.6e9  # measured peak RSS: 1277 MiB (1.34e9)
