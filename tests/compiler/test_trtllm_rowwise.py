"""FP8 rowwise (`method: fp8_dynamic`: per-channel FP8 weights, dynamic per-token FP8
activations) exported as TensorRT-LLM 1.2's FP8_PER_CHANNEL_PER_TOKEN checkpoint, read back,
and held to the rules of compiler/trtllm/rules/checkpoint.py."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from kiln.compiler.trtllm.export.decode import decode_checkpoint, read_checkpoint
from kiln.compiler.trtllm.export.writer import export_checkpoint
from kiln.compiler.trtllm.rules.checkpoint import check_checkpoint, check_config
from kiln.quant.quantize import quantize
from kiln.quant.schemes import resolve
from kiln.quant.spec import CalibrationSpec, QuantSpec
from kiln.runtime.base.errors import UsageError
from tests.compiler.test_compile import kiln
from tests.compiler.test_trtllm_export import max_rel_error, reference_weights
from tests.compiler.trtllm_recipes import compile_conforming, scheme_recipe

CALIBRATION = CalibrationSpec(num_samples=4, max_seq_len=32)
ROWWISE = QuantSpec(method="fp8_dynamic", weight_bits=8, activations="fp8_dynamic")
MLP_0 = r"re:model\.layers\.0\.mlp\..*"
DOWN_0 = r"re:model\.layers\.0\.mlp\.down_proj$"


@pytest.fixture(scope="module")
def rowwise(tmp_path_factory, tiny_llama, tiny_qwen2):
    """(arch, ignore) → the tiny model of `arch` quantised FP8 rowwise (made once)."""
    models, made = {"llama": tiny_llama, "qwen2": tiny_qwen2}, {}

    def get(arch: str, ignore: tuple[str, ...] = ("lm_head",)) -> Path:
        if (arch, ignore) not in made:
            out = tmp_path_factory.mktemp(f"rowwise-{arch}")
            quantize(models[arch], resolve(replace(ROWWISE, ignore=ignore)), CALIBRATION, out)
            made[arch, ignore] = out
        return made[arch, ignore]

    return get


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rowwise_checkpoint_conforms(rowwise, arch, tp, tmp_path):
    record = export_checkpoint(rowwise(arch), tmp_path, tp_size=tp)
    assert record["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN"
    assert check_checkpoint(tmp_path) == []


def test_rowwise_layout_is_fp8_weights_with_one_float32_scale_per_output_row(rowwise, tmp_path):
    export_checkpoint(rowwise("llama"), tmp_path, tp_size=2)
    config, ranks = read_checkpoint(tmp_path)
    assert config["quantization"]["quant_algo"] == "FP8_PER_CHANNEL_PER_TOKEN"
    assert config["quantization"]["exclude_modules"] == []
    for rank in ranks:
        weight = rank["transformer.layers.0.mlp.fc.weight"]
        scale = rank["transformer.layers.0.mlp.fc.per_channel_scale"]
        assert weight.dtype == torch.float8_e4m3fn and weight.shape == (256 // 2, 128)
        assert scale.dtype == torch.float32 and scale.shape == (256 // 2,)
        assert rank["lm_head.weight"].dtype == torch.bfloat16
        assert not any(k.endswith("activation_scaling_factor") for k in rank)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_rowwise_decodes_to_the_quantisers_dequantised_weights(rowwise, arch, tmp_path):
    export_checkpoint(rowwise(arch), tmp_path)
    reference = reference_weights(rowwise(arch))
    decoded = decode_checkpoint(tmp_path)
    for name, tensor in decoded.items():
        if name.endswith(".weight"):  # bf16 storage of the float tensors moves them < 2^-8
            assert max_rel_error(tensor, reference[name]) < 2**-7, name
    if arch == "qwen2":
        assert "model.layers.0.self_attn.q_proj.bias" in decoded


@pytest.mark.parametrize("tp", [2, 4])
def test_rowwise_shards_reassemble_to_the_tp1_weights(rowwise, tp, tmp_path):
    export_checkpoint(rowwise("llama"), tmp_path / "one")
    export_checkpoint(rowwise("llama"), tmp_path / "many", tp_size=tp)
    one, many = decode_checkpoint(tmp_path / "one"), decode_checkpoint(tmp_path / "many")
    assert one.keys() == many.keys()
    assert all(torch.equal(one[k], many[k]) for k in one)


def test_a_float_mlp_block_is_excluded_with_the_norm_that_feeds_it(rowwise, tmp_path):
    export_checkpoint(rowwise("llama", ("lm_head", MLP_0)), tmp_path)
    config, (rank,) = read_checkpoint(tmp_path)
    assert config["quantization"]["exclude_modules"] == [
        "transformer.layers.0.mlp",
        "transformer.layers.0.post_layernorm",
    ]
    assert rank["transformer.layers.0.mlp.proj.weight"].dtype == torch.bfloat16
    assert rank["transformer.layers.1.mlp.proj.weight"].dtype == torch.float8_e4m3fn
    assert check_checkpoint(tmp_path) == []


def test_one_float_linear_in_a_quantised_block_is_refused(rowwise, tmp_path):
    with pytest.raises(UsageError) as err:
        export_checkpoint(rowwise("llama", ("lm_head", DOWN_0)), tmp_path)
    assert "transformer.layers.0.mlp.proj" in err.value.message
    assert "whole attention and MLP blocks" in err.value.message


_CONFIG = {
    "architecture": "LlamaForCausalLM",
    "dtype": "bfloat16",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
}


def test_rowwise_exclusions_naming_a_linear_or_splitting_norm_and_block_are_named():
    config = {
        **_CONFIG,
        "quantization": {
            "quant_algo": "FP8_PER_CHANNEL_PER_TOKEN",
            "exclude_modules": ["transformer.layers.0.mlp.proj", "transformer.layers.0.attention"],
        },
    }
    assert check_config(config) == [
        "transformer.layers.0.input_layernorm and transformer.layers.0.attention: FP8 rowwise "
        "swaps a norm and the block it feeds together; exclude both or neither",
        "exclude_modules 'transformer.layers.0.mlp.proj' names the linear "
        "transformer.layers.0.mlp.proj: FP8 rowwise swaps whole blocks, so it is quantised "
        "with transformer.layers.0.mlp",
    ]


def test_a_per_tensor_fp8_checkpoint_declared_rowwise_fails_conformance(tiny_llama, tmp_path):
    spec = QuantSpec(method="fp8", weight_bits=8, activations="fp8_static")
    quantize(tiny_llama, resolve(spec), CALIBRATION, tmp_path / "q")
    export_checkpoint(tmp_path / "q", tmp_path / "trt")
    path = tmp_path / "trt" / "config.json"
    config = json.loads(path.read_text())
    config["quantization"]["quant_algo"] = "FP8_PER_CHANNEL_PER_TOKEN"
    path.write_text(json.dumps(config))
    problems = check_checkpoint(tmp_path / "trt")
    assert "rank0: transformer.layers.0.mlp.fc.per_channel_scale is required but not provided" in (
        problems
    )


def _recipe(tmp_path: Path, model: Path, target: str, path: str = "both") -> Path:
    return scheme_recipe(tmp_path, model, {"method": "fp8_dynamic"}, target, path)


def test_validate_takes_rowwise_for_hopper_engines(tmp_path, tiny_llama):
    code, _, stderr = kiln("validate", str(_recipe(tmp_path, tiny_llama, "h100-sxm", "engine")))
    assert code == 0, stderr


def test_validate_refuses_rowwise_engines_on_blackwell_with_the_reason(tmp_path, tiny_llama):
    code, _, stderr = kiln("validate", str(_recipe(tmp_path, tiny_llama, "b200", "engine")))
    assert code == 2
    assert "FP8_PER_CHANNEL_PER_TOKEN does not run on b200" in stderr
    assert "no FP8 rowwise" in stderr


def test_compile_plans_a_rowwise_engine_and_a_conforming_serve_config(tmp_path, tiny_llama):
    status, artifact = compile_conforming(_recipe(tmp_path, tiny_llama, "h100-sxm"), "h100-sxm")
    assert status == {"engine": "planned", "pytorch": "ready"}
    assert any(artifact.glob("**/rank0.safetensors"))
