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
    # Static activations: TensorRT-LLM's "ootb" SmoothQuant linears (the plugin layers drop
    # Qwen3's q/k norms: compiler/trtllm/rules/engine.py).
    "smoothquant": (
        "quantization: {method: smoothquant, weight_bits: 8, activations: int8_static}\n"
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


# ---- mixture of experts ----------------------------------------------------------------------

# Qwen3-30B-A3B's config.json (the fields the shapes need): 30.5B parameters, 3.3B active.
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
    "max_position_embeddings": 40960, "tie_word_embeddings": False, "rope_theta": 1000000.0,
}  # fmt: skip


def test_a_moe_models_weights_count_every_expert_and_its_decode_reads_the_active_ones() -> None:
    from kiln.compiler.trtllm.capacity import DeploySpec, plan
    from kiln.compiler.trtllm.targets import get_profile
    from kiln.quant.schemes import resolve
    from kiln.quant.spec import QuantSpec
    from kiln.runtime.formats.model_info import ModelInfo

    info = ModelInfo.from_hf_config(QWEN3_30B_A3B)
    assert (info.num_experts, info.num_experts_per_tok, info.norm_topk_prob) == (128, 8, True)
    assert info.num_parameters == pytest.approx(30.5e9, rel=0.01)
    active = sum(o * i for n in range(48) for o, i in info.active_linears(n).values())
    assert active + 2 * 151936 * 2048 == pytest.approx(3.3e9, rel=0.03)
    fp8 = resolve(QuantSpec(method="fp8", weight_bits=8, activations="fp8_static"))
    p = plan(info, fp8, get_profile("h200"), DeploySpec(max_seq_len=4096))
    assert p.fits and p.tp_size == 1
    assert p.weight_bytes == pytest.approx(30.5e9, rel=0.03)  # FP8: a byte per weight
    # The roofline reads the active linears (FP8, a byte each; the routers and the float
    # lm_head two) and half a sequence's KV, not the 128 experts' 30 GB.
    routers = 48 * 128 * 2048
    read = (active - routers) + 2 * routers + 2 * 151936 * 2048 + p.kv_bytes_per_token * 2048
    assert p.decode_tokens_per_s_bound == pytest.approx(4800e9 / read, rel=0.03)
    assert p.decode_tokens_per_s_bound > 5 * 4800e9 / p.weight_bytes


def moe_recipe(tmp_path: Path, model: Path, extra: str = "", targets: str = "[]") -> Path:
    path = tmp_path / "moe.yaml"
    path.write_text(
        f"name: moe\nmodel:\n  source: {model}\nquantization:\n  method: gptq\n"
        f"  group_size: 64\n{extra}"
        "calibration: {dataset: builtin:licenses, num_samples: 8, max_seq_len: 64}\n"
        f"report: {{num_samples: 4, max_seq_len: 64}}\ntargets: {targets}\noutput: out\n"
    )
    return path


def test_a_moe_model_compiles_with_every_expert_quantised_and_a_float_router(
    tiny_qwen3_moe: Path, tmp_path: Path
) -> None:
    from kiln.runtime.engine.layers.int4 import Int4Linear

    artifact = Path(compile_json(moe_recipe(tmp_path, tiny_qwen3_moe))["artifact"])
    model = Engine.from_pretrained(artifact / "model").model
    for index in (0, 2):
        sparse = model.layers[index].experts
        assert sparse is not None and len(sparse.gate_up) == 4
        assert all(isinstance(e, Int4Linear) for e in (*sparse.gate_up, *sparse.down))
        assert sparse.router.is_floating_point()
    assert model.layers[1].experts is None  # mlp_only_layers: a dense MLP
    # The report counts each kind: 2 sparse layers x 4 experts x 3, 2 float routers.
    report = json.loads((artifact / "reports" / "quantization.json").read_text())
    assert report["coverage"]["counts"] == {
        "attention": {"quantised": 12}, "mlp": {"quantised": 3},
        "expert": {"quantised": 24}, "router": {"float": 2}, "lm_head": {"float": 1},
    }  # fmt: skip
    assert report["coverage"]["unexpected_float"] == []
    page = (artifact / "reports" / "quantization.html").read_text()  # the report as a page
    assert "expert: 24 quantised" in page and page.count("<rect ") == len(report["layers"])


@pytest.mark.parametrize("fixture", ["tiny_mixtral", "tiny_qwen3_moe"])
def test_modelopt_quantises_every_expert_and_its_report_reads_the_experts_back(
    fixture: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """ModelOpt exports each expert's linears apart (Mixtral's w1/w3/w2): the report reads
    them back through transformers' own checkpoint conversion, every expert is quantised,
    the routers stay float, and kiln's runtime serves the export within FP8's tolerance of
    that model. ModelOpt calibrates each expert on its routed tokens only: the recipe says
    `moe_experts: warn` (the default `all` is refused for it by name)."""
    from kiln.quant.backends.modelopt import load_checkpoint
    from tests.runtime.conftest import assert_close_to_reference

    model = request.getfixturevalue(fixture)
    quant = "  backend: modelopt\n"
    path = (
        moe_recipe(tmp_path, model, quant)
        .read_text()
        .replace("method: gptq\n  group_size: 64", "method: fp8")
    )
    recipe_path = tmp_path / "modelopt.yaml"
    recipe_path.write_text(path)
    result = CliRunner().invoke(main, ["validate", str(recipe_path)])
    assert result.exit_code == 2 and "backend modelopt calibrates each expert" in result.stderr
    recipe_path.write_text(
        path.replace("max_seq_len: 64}", "max_seq_len: 64, moe_experts: warn}", 1)
    )
    artifact = Path(compile_json(recipe_path)["artifact"])
    report = json.loads((artifact / "reports" / "quantization.json").read_text())
    counts = report["coverage"]["counts"]
    assert counts["expert"] == {"quantised": 24} and counts["router"] == {"float": 2}
    assert report["coverage"]["unexpected_float"] == [] and report["format"] == "modelopt"
    reference, _ = load_checkpoint(artifact / "model")
    engine = Engine.from_pretrained(artifact / "model")
    assert_close_to_reference(engine, reference, 0.25, 0.05)


def test_mixtral_quantises_every_expert_under_its_own_names_and_serves_them(
    tiny_mixtral: Path, tmp_path: Path
) -> None:
    """llm-compressor saves Mixtral's experts as gate_proj/up_proj/down_proj (its linearised
    names); kiln writes them back as experts.N.w1/w3/w2, so the coverage check finds every
    expert quantised and kiln's runtime serves within W4A16's tolerance of transformers
    reading the same files."""
    from kiln.runtime.engine.layers.int4 import Int4Linear
    from tests.runtime.conftest import assert_close_to_reference

    artifact = Path(compile_json(moe_recipe(tmp_path, tiny_mixtral))["artifact"])
    report = json.loads((artifact / "reports" / "quantization.json").read_text())
    assert report["coverage"]["counts"]["expert"] == {"quantised": 2 * 4 * 3}
    assert report["coverage"]["unexpected_float"] == []
    engine = Engine.from_pretrained(artifact / "model")
    sparse = engine.model.layers[1].experts
    assert sparse is not None and all(isinstance(e, Int4Linear) for e in sparse.down)
    assert_close_to_reference(engine, hf_model(artifact / "model"), 0.05, 0.02)


def test_a_linear_the_quantiser_left_float_unasked_is_named(tiny_llama: Path, tmp_path: Path):
    """What a compile refuses (exit 2): a checkpoint whose quantiser skipped a linear the
    recipe did not ignore, and one where it quantised nothing."""
    from kiln.quant.coverage import coverage, coverage_problem
    from kiln.quant.quantize import quantize
    from kiln.quant.schemes import resolve
    from kiln.quant.spec import CalibrationSpec, QuantSpec
    from kiln.runtime.formats.checkpoint import read_config
    from kiln.runtime.formats.model_info import ModelInfo

    info = ModelInfo.from_hf_config(read_config(tiny_llama))
    skipped = ("lm_head", "model.layers.1.mlp.down_proj")
    spec = QuantSpec(method="fp8_dynamic", weight_bits=8, activations="fp8_dynamic", ignore=skipped)
    quantize(tiny_llama, resolve(spec), CalibrationSpec(), tmp_path / "q")
    found = coverage(tmp_path / "q", info, ("lm_head",))  # the recipe ignored only lm_head
    assert found["unexpected_float"] == ["model.layers.1.mlp.down_proj"]
    assert found["counts"]["mlp"] == {"quantised": 5, "float": 1}
    problem = coverage_problem(found, "FP8 rowwise")
    assert problem is not None and "left 1 linear(s) float" in problem
    assert "model.layers.1.mlp.down_proj" in problem
    assert coverage_problem(coverage(tmp_path / "q", info, skipped), "FP8 rowwise") is None
    nothing = coverage(tiny_llama, info, ("lm_head",))
    assert nothing["quantised"] == 0
    assert "quantised none of the model's linears" in (coverage_problem(nothing, "FP8") or "")


def test_an_ignore_list_that_keeps_every_expert_float_is_refused(
    tiny_qwen3_moe: Path, tmp_path: Path
) -> None:
    path = moe_recipe(tmp_path, tiny_qwen3_moe, '  ignore: [lm_head, "re:.*experts.*"]\n')
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2
    assert "keeps every expert of model.layers.0, model.layers.2 float" in result.stderr


def test_tensorrt_llm_targets_of_a_moe_model_are_refused_before_calibration(
    tiny_mixtral: Path, tmp_path: Path
) -> None:
    path = moe_recipe(tmp_path, tiny_mixtral, targets="[h100-sxm]")
    result = CliRunner().invoke(main, ["compile", str(path)])
    assert result.exit_code == 2
    # Neither path: kiln writes no group-wise int4 experts for the 1.2 engine, and the
    # PyTorch backend's fused MoE has no int4 weight-only experts.
    stderr = result.stderr.replace("\n", " ")
    assert "MixtralForCausalLM: W4A16_AWQ on the experts" in stderr
    assert "W4A16_AWQ on MixtralForCausalLM's experts" in stderr
    assert not (tmp_path / "out" / ".kiln-cache" / "quantize").exists()  # nothing calibrated


def test_phi3s_fused_projections_compile_quantised_for_the_pytorch_path_only(
    tiny_phi3: Path, tmp_path: Path
) -> None:
    """Phi-3 stores q/k/v and gate/up fused: each is one quantised linear, served as stored;
    TensorRT-LLM's PyTorch backend loads its FP8 rowwise checkpoint as it is, and the engine
    path is refused by name (kiln writes no FP8 rowwise layout of Phi-3's fused MLP)."""
    from kiln.runtime.engine.layers.fp8 import Fp8Linear

    path = tmp_path / "phi3.yaml"
    path.write_text(
        f"name: phi3\nmodel:\n  source: {tiny_phi3}\nquantization: {{method: fp8_dynamic}}\n"
        "report: {num_samples: 4, max_seq_len: 64}\ntargets: []\noutput: out\n"
    )
    artifact = Path(compile_json(path)["artifact"])
    report = json.loads((artifact / "reports" / "quantization.json").read_text())
    assert report["coverage"]["counts"] == {
        "attention": {"quantised": 4}, "mlp": {"quantised": 4}, "lm_head": {"float": 1},
    }  # fmt: skip
    layer = Engine.from_pretrained(artifact / "model").model.layers[0]
    assert isinstance(layer.qkv, Fp8Linear) and layer.qkv.out_features == 128 + 2 * 64
    path.write_text(path.read_text().replace("targets: []", "targets: [h100-sxm]"))
    assert CliRunner().invoke(main, ["validate", str(path)]).exit_code == 0
    engine = path.read_text().replace("output: out", "deploy: {trtllm_path: engine}\noutput: out")
    path.write_text(engine)
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2
    assert "Phi3ForCausalLM: FP8_PER_CHANNEL_PER_TOKEN: kiln does not write" in result.stderr


# google/gemma-3-4b-it's text config, as its config.json gives it (old field names).
GEMMA3_4B = {
    "architectures": ["Gemma3ForCausalLM"], "hidden_size": 2560, "intermediate_size": 10240,
    "num_hidden_layers": 34, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
    "vocab_size": 262208, "sliding_window": 1024, "sliding_window_pattern": 6,
    "query_pre_attn_scalar": 256, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "hidden_activation": "gelu_pytorch_tanh", "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
}  # fmt: skip


def test_plan_holds_only_the_window_on_gemma3s_sliding_layers() -> None:
    """Gemma 3 4B at 32k: its 29 sliding layers hold their 1,024-token window and the block it
    straddles, its 5 global ones (every sixth) all 32,768 tokens: a quarter of a full cache."""
    from kiln.compiler.trtllm.capacity import DeploySpec, plan
    from kiln.compiler.trtllm.targets import get_profile
    from kiln.quant.schemes import resolve
    from kiln.quant.spec import QuantSpec
    from kiln.runtime.formats.model_info import ModelInfo

    info = ModelInfo.from_hf_config(GEMMA3_4B)
    assert [i for i in range(34) if info.layer_window(i) is None] == [5, 11, 17, 23, 29]
    assert (info.rope_theta, info.local_rope_theta, info.query_pre_attn_scalar) == (1e6, 1e4, 256)
    assert info.rope_scaling == {"rope_type": "linear", "factor": 8.0} and info.gemma
    assert info.num_parameters == pytest.approx(3.88e9, rel=0.01)
    fp8 = resolve(QuantSpec(method="fp8", weight_bits=8, activations="fp8_static"))
    deploy = DeploySpec(max_seq_len=32768)
    p = plan(info, fp8, get_profile("h100-sxm"), deploy)
    per_layer_token = 2 * 4 * 256 * 2  # K and V x KV heads x head_dim x bf16
    assert p.kv_bytes_per_token == 34 * per_layer_token
    block = deploy.tokens_per_block
    window = (1024 // block + 1) * block
    assert p.kv_bytes_per_request == pytest.approx(per_layer_token * (5 * 32768 + 29 * window))
    assert p.kv_bytes_per_request < p.kv_bytes_per_token * 32768 / 4
    assert any("29 of 34 layers attend within a sliding window of 1024" in n for n in p.notes)


def test_gemma3_compiles_with_awq_and_its_zero_points_keep_it_off_tensorrt_llm(
    tiny_gemma3: Path, tmp_path: Path
) -> None:
    """Gemma 3 through llm-compressor's AWQ (its Gemma 3 mappings smooth into the offset
    norms): every decoder linear quantised, and the artifact serves within
    W4A16's tolerance of transformers on the same files."""
    from kiln.runtime.engine.layers.int4 import Int4Linear
    from tests.runtime.conftest import assert_close_to_reference

    path = tmp_path / "gemma3.yaml"
    path.write_text(
        f"name: gemma3\nmodel:\n  source: {tiny_gemma3}\nquantization: {{method: awq}}\n"
        "calibration: {dataset: builtin:licenses, num_samples: 8, max_seq_len: 64}\n"
        "report: {num_samples: 4, max_seq_len: 64}\ntargets: []\noutput: out\n"
    )
    artifact = Path(compile_json(path)["artifact"])
    report = json.loads((artifact / "reports" / "quantization.json").read_text())
    # the head is the embedding, tied: not a linear of its own
    assert report["coverage"]["counts"] == {"attention": {"quantised": 12}, "mlp": {"quantised": 9}}
    engine = Engine.from_pretrained(artifact / "model")
    assert isinstance(engine.model.layers[2].qkv, Int4Linear)
    assert_close_to_reference(engine, hf_model(artifact / "model"), 0.05, 0.02)
    path.write_text(path.read_text().replace("targets: []", "targets: [h100-sxm]"))
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2
    # AWQ's asymmetric groups: TensorRT-LLM's W4A16 AWQ layer reads no zero points, and the
    # 1.2 gemma model would scale the local RoPE like the global: both paths named.
    stderr = result.stderr.replace("\n", " ")
    assert "Gemma3ForCausalLM: rope scaling linear on the global layers" in stderr
    assert "asymmetric int4 groups" in stderr


def starved_moe(source: Path, target: Path) -> Path:
    """tiny_qwen3_moe with experts 2 and 3 of every sparse layer never routed: every embedding
    carries a large first coordinate, which the residual stream keeps, and the routers score
    it positively for experts 0 and 1 and negatively for 2 and 3."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    tensors["model.embed_tokens.weight"][:, 0] = 50.0
    for layer in (0, 2):
        router = torch.zeros_like(tensors[f"model.layers.{layer}.mlp.gate.weight"])
        router[:2, 0], router[2:, 0] = 10.0, -10.0
        tensors[f"model.layers.{layer}.mlp.gate.weight"] = router
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


@pytest.mark.parametrize("policy", ["warn", "fail", "all"])
def test_experts_the_calibration_never_reaches_are_reported_or_refused(
    tiny_qwen3_moe: Path, tmp_path: Path, policy: str
) -> None:
    model = starved_moe(tiny_qwen3_moe, tmp_path / "starved")
    path = moe_recipe(tmp_path, model)
    calibration = "num_samples: 8, max_seq_len: 64"
    path.write_text(path.read_text().replace(calibration, f"{calibration}, moe_experts: {policy}"))
    names = [f"model.layers.{i}.mlp.experts.{e}" for i in (0, 2) for e in (2, 3)]
    result = CliRunner().invoke(main, ["compile", str(path), "--json"])
    if policy == "fail":
        assert result.exit_code == 2
        assert "4 expert(s) were routed fewer than 16 calibration tokens" in result.stderr
        assert all(f"{n} (0 tokens)" in result.stderr for n in names)
        return
    assert result.exit_code == 0, result.stderr
    artifact = Path(json.loads(result.stdout)["artifact"])
    routing = json.loads((artifact / "reports" / "quantization.json").read_text())["moe_routing"]
    assert routing["policy"] == policy
    assert [s["expert"] for s in routing["starved"]] == names
    assert all(s["tokens"] == 0 for s in routing["starved"])
    assert routing["tokens_per_expert"]["0"][2:] == [0, 0]


def test_every_expert_on_every_token_is_refused_where_the_backend_cannot(tiny_qwen3_moe: Path):
    from kiln.quant.quantize import quantize
    from kiln.quant.schemes import resolve
    from kiln.quant.spec import CalibrationSpec, QuantSpec
    from kiln.runtime.base.errors import PreflightError

    fp8 = QuantSpec(method="fp8", weight_bits=8, activations="fp8_static", backend="modelopt")
    with pytest.raises(PreflightError, match="backend modelopt calibrates each expert on"):
        quantize(tiny_qwen3_moe, resolve(fp8), CalibrationSpec(), Path("/nonexistent"))


def requantised_recipe(tmp_path: Path, model: Path, quant: str) -> Path:
    """moe_recipe with `quant` (the quantization section's lines) in place of its GPTQ."""
    path = moe_recipe(tmp_path, model)
    path.write_text(path.read_text().replace("method: gptq\n  group_size: 64\n", quant))
    return path


@pytest.mark.parametrize("fixture", ["tiny_mixtral", "tiny_qwen3_moe"])
@pytest.mark.parametrize(
    "quant",
    [
        "method: smoothquant\n",  # int8 dynamic activations
        "method: smoothquant\n  activations: int8_static\n",
        "method: smoothquant\n  ignore: [lm_head, 're:.*experts[.]0[.].*']\n",
    ],
    ids=["int8-dynamic", "int8-static", "expert-0-float"],
)
def test_int8_smoothquant_experts_from_llm_compressor_are_refused_at_validate(
    fixture: str, quant: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """transformers 5 cannot read llm-compressor's int8 experts back (it fuses each expert's
    int8 w1/w3 into gate_up_proj and finds none: "Ckpt contains: 0", exit 3 after
    calibrating), whatever the activations and however few experts stay int8."""
    model = request.getfixturevalue(fixture)
    path = requantised_recipe(tmp_path, model, quant)
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2
    stderr = result.stderr.replace("\n", " ")
    arch = "MixtralForCausalLM" if fixture == "tiny_mixtral" else "Qwen3MoeForCausalLM"
    assert f"quantization.method: W8A8_SQ from llmcompressor on {arch}'s experts" in stderr
    assert "backend: modelopt" in stderr and "method fp8 or fp8_dynamic" in stderr


@pytest.mark.parametrize(
    "quant",
    [
        "method: awq\n  group_size: 64\n",  # AWQ's default: zero points
        "method: gptq\n  group_size: 64\n  symmetric: false\n",
        "method: gptq\n  weight_bits: 8\n  symmetric: false\n",
    ],
    ids=["awq", "gptq-asymmetric", "w8a16-asymmetric"],
)
def test_experts_with_zero_points_from_llm_compressor_are_refused_at_validate(
    quant: str, tiny_mixtral: Path, tmp_path: Path
) -> None:
    """transformers 5 reloads llm-compressor's experts only without zero points ("Asymmetric
    quant requires zero-point values", exit 3 after calibrating); symmetric AWQ validates."""
    result = CliRunner().invoke(
        main, ["validate", str(requantised_recipe(tmp_path, tiny_mixtral, quant))]
    )
    assert result.exit_code == 2
    stderr = result.stderr.replace("\n", " ")
    assert "quantization.symmetric: " in stderr and "with zero points from llmcompressor" in stderr
    assert "symmetric: true (no zero points)" in stderr
    symmetric = requantised_recipe(tmp_path, tiny_mixtral, "method: awq\n  symmetric: true\n")
    assert CliRunner().invoke(main, ["validate", str(symmetric)]).exit_code == 0


def test_int8_smoothquant_experts_from_modelopt_compile_and_serve(
    tiny_mixtral: Path, tmp_path: Path
) -> None:
    """What the refusal above offers: ModelOpt's int8 SmoothQuant (static activations) of every
    expert, read back and served by kiln's runtime on its int8 kernels, routers float."""
    from kiln.runtime.engine.layers.int8 import Int8Linear

    quant = "method: smoothquant\n  activations: int8_static\n  backend: modelopt\n"
    path = requantised_recipe(tmp_path, tiny_mixtral, quant)
    path.write_text(
        path.read_text().replace("max_seq_len: 64}", "max_seq_len: 64, moe_experts: warn}", 1)
    )
    artifact = Path(compile_json(path)["artifact"])
    report = json.loads((artifact / "reports" / "quantization.json").read_text())
    assert report["coverage"]["counts"]["expert"] == {"quantised": 2 * 4 * 3}
    sparse = Engine.from_pretrained(artifact / "model").model.layers[1].experts
    assert sparse is not None and sparse.router.is_floating_point()
    assert all(isinstance(e, Int8Linear) for e in (*sparse.gate_up, *sparse.down))


def test_where_a_moe_artifact_serves_instead_is_said_as_vllm_runs_it(
    tiny_mixtral: Path, tmp_path: Path
) -> None:
    """W4A16 experts refused on both TensorRT-LLM paths: vLLM runs int4 MoE experts on CUDA,
    and its CPU build only on x86 CPUs with AMX (its one int4 MoE kernel needs AMX tiles)."""
    path = moe_recipe(tmp_path, tiny_mixtral, targets="[h100-sxm]")
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2
    stderr = result.stderr.replace("\n", " ")
    assert (
        "the artifact serves on kiln serve, and vLLM on CUDA GPUs; vLLM's CPU build runs " in stderr
    )
    assert "int4 MoE experts only on x86 CPUs with AMX" in stderr
