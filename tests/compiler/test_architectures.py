"""Architectures beyond Llama, end to end: `kiln plan` reads their shapes, `kiln compile`
quantises and exports them for both TensorRT-LLM paths, and the artifact serves.

Qwen3 (tiny_qwen3: per-head q/k RMSNorm, explicit head_dim 64 with 4 heads over a hidden size
of 128) through llm-compressor: FP8 to the PyTorch path (ModelOpt HF checkpoint, its q_norm and
k_norm read under their HF names) and INT8 SmoothQuant to the engine path (qwen_type qwen3,
`attention.{q,k}_layernorm`); each export's own conformance rules hold for the file written.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from safetensors import safe_open

from kiln.compiler.cli.main import main
from kiln.compiler.trtllm.rules.checkpoint import check_checkpoint
from kiln.compiler.trtllm.rules.pytorch import check_hf_checkpoint
from kiln.runtime import Engine, SamplingParams
from tests.runtime.conftest import hf_greedy, hf_model, prompt_ids

QUANTISATION = {
    "fp8": "quantization: {method: fp8}\n",
    "smoothquant": (
        "quantization: {method: smoothquant, weight_bits: 8, activations: int8_dynamic}\n"
        "deploy: {trtllm_path: engine}\n"
    ),
}


def recipe(tmp_path: Path, model: Path, scheme: str) -> Path:
    path = tmp_path / f"{scheme}.yaml"
    path.write_text(
        f"name: arch-{scheme}\nmodel:\n  source: {model}\n{QUANTISATION[scheme]}"
        "calibration: {dataset: builtin:licenses, num_samples: 8, max_seq_len: 64}\n"
        "report: {num_samples: 4, max_seq_len: 64}\ntargets: [h100-sxm]\noutput: out\n"
    )
    return path


def compile_json(path: Path) -> dict:
    result = CliRunner().invoke(main, ["compile", str(path), "--json"])
    assert result.exit_code == 0, result.stderr
    return json.loads(result.stdout)


def test_plan_reads_qwen3s_explicit_head_dim(tiny_qwen3: Path, tmp_path: Path) -> None:
    result = CliRunner().invoke(main, ["plan", str(recipe(tmp_path, tiny_qwen3, "fp8")), "--json"])
    assert result.exit_code == 0, result.stderr
    plan = json.loads(result.stdout)["h100-sxm"]
    assert plan["model"] == "Qwen3ForCausalLM"
    # 2 (K, V) x 2 layers x 2 KV heads x head_dim 64 x 2 bytes (bf16 KV): not hidden / heads.
    assert plan["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 2


def test_qwen3_compiles_to_the_pytorch_path_with_its_head_norms(
    tiny_qwen3: Path, tmp_path: Path
) -> None:
    result = compile_json(recipe(tmp_path, tiny_qwen3, "fp8"))
    artifact = Path(result["artifact"])
    manifest = json.loads((artifact / "manifest.json").read_text())
    assert manifest["source"]["architecture"] == "Qwen3ForCausalLM"
    hf = artifact / "trtllm" / "hf"
    assert check_hf_checkpoint(hf, 1) == []
    with safe_open(str(hf / "model.safetensors"), "pt") as f:
        norm = f.get_tensor("model.layers.1.self_attn.k_norm.weight")
    assert norm.shape == (64,) and norm.is_floating_point() and norm.element_size() >= 2
    # The artifact serves: float32 greedy continuations are transformers' on the same files.
    model_dir = artifact / "model"
    engine = Engine.from_pretrained(model_dir, dtype="float32")
    prompt = prompt_ids(model_dir, 1)[0]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    out = engine.generate([prompt], params)[0]
    assert out.token_ids == hf_greedy(hf_model(model_dir), prompt, 12)


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen3_compiles_to_the_engine_path_as_qwen_type_qwen3(
    tiny_qwen3: Path, tmp_path: Path, tp: int
) -> None:
    path = recipe(tmp_path, tiny_qwen3, "smoothquant")
    engine_tp = f"trtllm_path: engine, tp_size: {tp}}}"
    path.write_text(path.read_text().replace("trtllm_path: engine}", engine_tp))
    artifact = Path(compile_json(path)["artifact"])
    ckpt = next((artifact / "trtllm").iterdir())
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architecture"] == "Qwen3ForCausalLM"
    assert (config["qwen_type"], config["attn_bias"], config["head_size"]) == ("qwen3", False, 64)
    assert config["mapping"]["tp_size"] == tp
    assert check_checkpoint(ckpt) == []
    with safe_open(str(ckpt / "rank0.safetensors"), "pt") as f:
        names = set(f.keys())
    for layer in range(2):
        for norm in ("q_layernorm", "k_layernorm"):
            assert f"transformer.layers.{layer}.attention.{norm}.weight" in names
