"""NVFP4 (`method: nvfp4`, ModelOpt) for Blackwell: TensorRT-LLM 1.2's NVFP4 checkpoint
against ModelOpt's own writer and read back, Llama and Qwen2 at tp 1, 2 and 4 held to the
conformance rules, validated per target and path, and compiled on a CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kiln.compiler.trtllm.export.decode import decode_checkpoint, read_checkpoint
from kiln.compiler.trtllm.export.writer import export_checkpoint
from kiln.compiler.trtllm.rules.checkpoint import check_checkpoint, check_config
from kiln.quant.spec import QuantSpec
from kiln.runtime.formats.checkpoint import open_checkpoint
from kiln.runtime.formats.nvfp4 import unpack_e2m1
from kiln.runtime.formats.weights import dequantize
from tests.compiler.test_compile import kiln
from tests.compiler.test_trtllm_modelopt import modelopt_exports  # noqa: F401
from tests.compiler.trtllm_recipes import compile_conforming, quantised_per_arch, scheme_recipe

NVFP4 = QuantSpec(method="nvfp4", weight_bits=4, activations="nvfp4", backend="modelopt")


def test_nvfp4_matches_modelopts_writer(modelopt_exports):  # noqa: F811
    theirs_dir, ours_dir = modelopt_exports("NVFP4_DEFAULT_CFG")
    config_o, (ours,) = read_checkpoint(ours_dir)
    config_m, (theirs,) = read_checkpoint(theirs_dir)
    assert config_o["quantization"] == config_m["quantization"]
    assert set(ours) == set(theirs)
    for name, b in theirs.items():
        a = ours[name]
        assert (a.shape, a.dtype) == (b.shape, b.dtype), name
        if a.dtype == torch.uint8:  # ModelOpt's writers round < 1% of codes differently
            assert (unpack_e2m1(a) != unpack_e2m1(b)).float().mean() < 0.01, name
        else:
            assert torch.equal(a, b), name
    assert check_checkpoint(ours_dir) == []
    assert check_checkpoint(theirs_dir) == []  # NVIDIA's writer obeys the rules read from TRT-LLM


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory, tiny_llama, tiny_qwen2):
    """arch → the tiny model of `arch` quantised NVFP4 by kiln's ModelOpt backend."""
    models = {"llama": tiny_llama, "qwen2": tiny_qwen2}
    return quantised_per_arch(tmp_path_factory, models, NVFP4, "nvfp4")


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_nvfp4_checkpoint_conforms(nvfp4, arch, tp, tmp_path):
    export_checkpoint(nvfp4(arch), tmp_path, tp_size=tp)
    assert check_checkpoint(tmp_path) == []
    config, ranks = read_checkpoint(tmp_path)
    assert config["quantization"]["group_size"] == 16
    for rank in ranks:
        assert rank["transformer.layers.0.mlp.proj.weight"].shape == (128, 256 // tp // 2)
        assert rank["transformer.layers.0.mlp.proj.weights_scaling_factor"].shape == (128, 16 // tp)


def test_nvfp4_decodes_to_the_exported_weights(nvfp4, tmp_path):
    export_checkpoint(nvfp4("qwen2"), tmp_path / "one")
    export_checkpoint(nvfp4("qwen2"), tmp_path / "two", tp_size=2)
    one, two = decode_checkpoint(tmp_path / "one"), decode_checkpoint(tmp_path / "two")
    assert all(torch.equal(one[k], two[k]) for k in one)
    ckpt = open_checkpoint(nvfp4("qwen2"))
    for name in ("self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.down_proj"):
        module = f"model.layers.1.{name}"
        want = dequantize(ckpt.linear(module), torch.float32)
        assert torch.allclose(one[f"{module}.weight"], want, rtol=1e-6, atol=0), module


def test_nvfp4_input_features_must_split_into_blocks_of_16():
    config = {
        "hidden_size": 128,
        "intermediate_size": 200,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
        "mapping": {"world_size": 2, "tp_size": 2, "pp_size": 1},
        "quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]},
    }
    assert check_config(config) == [
        "transformer.layers.0.mlp.proj: 100 input features per rank; FP4 GEMMs take a "
        "multiple of 16"
    ]


def _recipe(tmp_path: Path, model: Path, target: str, path: str = "both") -> Path:
    return scheme_recipe(tmp_path, model, {"method": "nvfp4"}, target, path)


@pytest.mark.parametrize(("target", "path"), [("b200", "both"), ("gb200", "engine")])
def test_validate_takes_nvfp4_for_blackwell(tmp_path, tiny_llama, target, path):
    code, _, stderr = kiln("validate", str(_recipe(tmp_path, tiny_llama, target, path)))
    assert code == 0, stderr


@pytest.mark.parametrize("target", ["h100-sxm", "l40s", "a100-80gb"])
def test_validate_refuses_nvfp4_before_blackwell(tmp_path, tiny_llama, target):
    code, _, stderr = kiln("validate", str(_recipe(tmp_path, tiny_llama, target)))
    assert code == 2
    assert "has no FP4 tensor cores; NVFP4 needs Blackwell" in stderr


def test_compile_plans_an_nvfp4_engine_and_serves_the_modelopt_export(tmp_path, tiny_llama):
    status, artifact = compile_conforming(_recipe(tmp_path, tiny_llama, "b200"), "b200")
    assert status == {"engine": "planned", "pytorch": "ready"}
    quant = json.loads(next(artifact.glob("**/hf_quant_config.json")).read_text())
    assert quant["quantization"]["quant_algo"] == "NVFP4"
    assert any(artifact.glob("**/rank0.safetensors"))
