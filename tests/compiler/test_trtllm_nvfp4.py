"""NVFP4 (`method: nvfp4`, ModelOpt) for Blackwell: validated per target and path, compiled on
a CPU into ModelOpt's HF export that TensorRT-LLM's PyTorch backend serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kiln.compiler.trtllm.conformance import check_serve_options
from tests.compiler.test_compile import kiln


def _recipe(tmp_path: Path, model: Path, target: str, path: str = "both") -> Path:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"""\
name: tiny-nvfp4
model:
  source: {model}
quantization:
  method: nvfp4
calibration:
  dataset: builtin:licenses
  num_samples: 4
  max_seq_len: 32
report:
  num_samples: 4
  max_seq_len: 32
targets: [{target}]
deploy:
  trtllm_path: {path}
output: out
""")
    return recipe


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
    code, stdout, stderr = kiln("compile", str(_recipe(tmp_path, tiny_llama, "b200")), "--json")
    assert code == 0, stderr
    result = json.loads(stdout.splitlines()[-1])  # ModelOpt prints its own lines first
    status = result["targets"]["b200"]
    assert status["pytorch"] == "ready"
    assert status["engine"].startswith("unsupported:") and "not exported" in status["engine"]
    artifact = Path(result["artifact"])
    quant = json.loads(next(artifact.glob("**/hf_quant_config.json")).read_text())
    assert quant["quantization"]["quant_algo"] == "NVFP4"
    options = yaml.safe_load((artifact / "engines" / "b200" / "trtllm-serve.yaml").read_text())
    assert check_serve_options(options) == []
