"""NVFP4 (`method: nvfp4`, ModelOpt) for Blackwell: validated per target and path, compiled on
a CPU into ModelOpt's HF export that TensorRT-LLM's PyTorch backend serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.compiler.test_compile import kiln
from tests.compiler.trtllm_recipes import compile_conforming, scheme_recipe


def _recipe(tmp_path: Path, model: Path, target: str, path: str = "both") -> Path:
    return scheme_recipe(tmp_path, model, {"method": "nvfp4"}, target, path)


@pytest.mark.parametrize("target", ["b200", "gb200"])
def test_validate_takes_nvfp4_for_blackwells_pytorch_path(tmp_path, tiny_llama, target):
    code, _, stderr = kiln("validate", str(_recipe(tmp_path, tiny_llama, target, "pytorch")))
    assert code == 0, stderr


@pytest.mark.parametrize("target", ["h100-sxm", "l40s", "a100-80gb"])
def test_validate_refuses_nvfp4_before_blackwell(tmp_path, tiny_llama, target):
    code, _, stderr = kiln("validate", str(_recipe(tmp_path, tiny_llama, target)))
    assert code == 2
    assert "has no FP4 tensor cores; NVFP4 needs Blackwell" in stderr


def test_validate_refuses_an_nvfp4_engine_with_the_reason_and_the_fix(tmp_path, tiny_llama):
    code, _, stderr = kiln("validate", str(_recipe(tmp_path, tiny_llama, "b200", "engine")))
    assert code == 2
    assert "NVFP4 engine checkpoint is not exported yet" in stderr
    assert "trtllm_path: pytorch" in stderr


def test_compile_serves_nvfp4_on_the_pytorch_path(tmp_path, tiny_llama):
    status, artifact = compile_conforming(_recipe(tmp_path, tiny_llama, "b200"), "b200")
    assert status["pytorch"] == "ready"
    assert status["engine"].startswith("unsupported:") and "not exported" in status["engine"]
    quant = json.loads(next(artifact.glob("**/hf_quant_config.json")).read_text())
    assert quant["quantization"]["quant_algo"] == "NVFP4"
