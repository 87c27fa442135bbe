"""Phi-3, Gemma 3, Mixtral and Qwen3-MoE on TensorRT-LLM: the PyTorch path serves a ModelOpt
HF checkpoint each family's loader reads (compiler/trtllm/rules/pytorch.py, rules cited from
TensorRT-LLM's _torch/models), and what a family's loader would read differently (Qwen3-MoE's
routing options, W4A16 experts) is refused. Their 1.2 engine checkpoints are
test_trtllm_engine_families.py's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kiln.compiler.cli.main import main
from kiln.compiler.trtllm.export.modelopt_hf import convert_to_modelopt_hf
from kiln.compiler.trtllm.rules.pytorch import check_hf_checkpoint
from kiln.quant.quantize import quantize
from kiln.quant.schemes import resolve
from kiln.quant.spec import CalibrationSpec, QuantSpec
from kiln.runtime.formats.model_info import ModelInfo, with_legacy_rope
from tests.tiny_models import make_tiny_model

FP8 = QuantSpec(method="fp8", weight_bits=8, activations="fp8_static")
CALIBRATION = CalibrationSpec(num_samples=8, max_seq_len=64)


@pytest.fixture(scope="module")
def tiny_qwen3_moe_routed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer Qwen3-MoE as its released checkpoints are: every layer sparse, top-k
    renormalised (what TensorRT-LLM's Qwen3-MoE builds)."""
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-qwen3-moe-routed"), arch="qwen3_moe", norm_topk_prob=True
    )


@pytest.fixture(scope="module")
def converted(tmp_path_factory, tiny_phi3, tiny_gemma3, tiny_mixtral, tiny_qwen3_moe_routed):
    """family → (its FP8 llm-compressor checkpoint, the ModelOpt HF conversion of it)."""
    models = {"phi3": tiny_phi3, "gemma3": tiny_gemma3, "mixtral": tiny_mixtral,
              "qwen3_moe": tiny_qwen3_moe_routed}  # fmt: skip
    made: dict[str, tuple[Path, Path]] = {}

    def get(family: str) -> tuple[Path, Path]:
        if family not in made:
            root = tmp_path_factory.mktemp(f"family-{family}")
            quantize(models[family], resolve(FP8), CALIBRATION, root / "ct")
            convert_to_modelopt_hf(root / "ct", root / "hf")
            made[family] = (root / "ct", root / "hf")
        return made[family]

    return get


def tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


@pytest.mark.parametrize("family", ["phi3", "gemma3", "mixtral", "qwen3_moe"])
def test_each_familys_fp8_checkpoint_holds_what_its_pytorch_loader_reads(converted, family):
    """Every linear the family's loader reads under its HF name, float8 codes and 0-d scales
    exactly as the quantiser wrote them (dequantised, equal), at tp 1 and 2."""
    ct, hf = converted(family)
    for tp in (1, 2):
        assert check_hf_checkpoint(hf, tp) == []
    source, written = tensors(ct), tensors(hf)
    config = json.loads((hf / "config.json").read_text())
    info = ModelInfo.from_hf_config(config)
    for name in info.layer_linears(0):
        module = f"model.layers.0.{name}"
        if info.moe is not None and name == f"{info.moe.block}.{info.moe.router}":
            continue
        w, s = written[f"{module}.weight"], written[f"{module}.weight_scale"]
        assert w.dtype == torch.float8_e4m3fn and s.shape == () and s.dtype == torch.float32
        want = source[f"{module}.weight"].float() * source[f"{module}.weight_scale"].float()
        assert torch.equal(w.float() * s, want), module
        assert written[f"{module}.input_scale"].shape == ()


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_routers_stay_float_and_excluded_and_every_expert_is_quantised(converted, family):
    """The PyTorch backend builds the router unquantised: kiln writes it float, as stored,
    and lists it in exclude_modules; every expert of every layer is FP8."""
    ct, hf = converted(family)
    quant = json.loads((hf / "hf_quant_config.json").read_text())["quantization"]
    info = ModelInfo.from_hf_config(json.loads((hf / "config.json").read_text()))
    moe = info.moe
    assert moe is not None
    routers = [f"model.layers.{i}.{moe.block}.{moe.router}" for i in range(info.num_layers)]
    assert set(routers) <= set(quant["exclude_modules"])
    assert not any(".experts." in m for m in quant["exclude_modules"])
    written, source = tensors(hf), tensors(ct)
    for router in routers:
        assert torch.equal(written[f"{router}.weight"], source[f"{router}.weight"])
        assert written[f"{router}.weight"].is_floating_point()
    experts = [k for k in written if ".experts." in k and k.endswith(".weight")]
    assert len(experts) == info.num_layers * info.num_experts * 3
    assert all(written[k].dtype == torch.float8_e4m3fn for k in experts)
    names = {moe.gate, moe.up, moe.down}
    assert {k.rsplit(".", 2)[-2] for k in experts} == names  # the family's own expert names


def test_mixtrals_experts_are_saved_under_mixtrals_own_names(converted):
    """llm-compressor saves Mixtral's experts under its linearised names (gate_proj, up_proj,
    down_proj); kiln renames them to experts.N.w1/w3/w2, what every loader of Mixtral reads."""
    ct, _ = converted("mixtral")
    names = set(tensors(ct))
    assert "model.layers.0.block_sparse_moe.experts.3.w1.weight" in names
    assert "model.layers.1.block_sparse_moe.experts.0.w2.weight_scale" in names
    assert not any("gate_proj" in n or "down_proj" in n or "up_proj" in n for n in names)


def test_gemma3s_norms_are_written_as_hf_stores_them(converted, tiny_gemma3):
    """TensorRT-LLM's Gemma 3 mapper adds the 1 of Gemma's (1 + weight) to every norm on load:
    the checkpoint carries the norms as Hugging Face stores them, all four a layer, and the
    q/k norms; config.json keeps layer_types and spells each RoPE base for transformers 4."""
    ct, hf = converted("gemma3")
    written, source = tensors(hf), tensors(ct)
    original = load_file(tiny_gemma3 / "model.safetensors")
    for i in range(3):
        for norm in ("input_layernorm", "post_attention_layernorm",
                     "pre_feedforward_layernorm", "post_feedforward_layernorm"):  # fmt: skip
            name = f"model.layers.{i}.{norm}.weight"
            assert torch.equal(written[name], source[name]), name
            # llm-compressor offsets Gemma's norms while it calibrates and back: float
            # rounding apart, they are the model's own (an offset of 1 would show here).
            torch.testing.assert_close(written[name], original[name], atol=1e-6, rtol=0)
        assert written[f"model.layers.{i}.self_attn.q_norm.weight"].shape == (32,)
    config = json.loads((hf / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)
    assert config["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}


def test_a_norm_written_with_kilns_offset_would_be_refused_by_value_not_shape(converted, tmp_path):
    """What the rules can and cannot see: a Gemma norm stored folded (1 + w) has the right
    name, shape and dtype, so only the value comparison above catches it."""
    _, hf = converted("gemma3")
    folded = tmp_path / "folded"
    shutil.copytree(hf, folded)
    state = load_file(folded / "model.safetensors")
    state["model.norm.weight"] = state["model.norm.weight"] + 1
    save_file(state, folded / "model.safetensors")
    assert check_hf_checkpoint(folded, 1) == []


def test_legacy_rope_keys_are_added_and_transformers_reads_the_same_rope(tiny_gemma3, tmp_path):
    """transformers 5 writes rope_parameters only; transformers 4.57 (TensorRT-LLM 1.2's)
    would read RoPE base 10000 unscaled from that. The legacy keys read as the same RoPE."""
    from transformers import AutoConfig

    config = json.loads((tiny_gemma3 / "config.json").read_text())
    assert "rope_theta" not in config
    spelled = with_legacy_rope(config)
    assert spelled["rope_theta"] == 1_000_000.0 and spelled["rope_local_base_freq"] == 10_000.0
    assert with_legacy_rope({**spelled, "rope_theta": 5.0})["rope_theta"] == 5.0  # kept
    shutil.copytree(tiny_gemma3, tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps(spelled))
    a, b = AutoConfig.from_pretrained(tiny_gemma3), AutoConfig.from_pretrained(tmp_path / "m")
    assert a.rope_parameters == b.rope_parameters
    one, two = ModelInfo.from_hf_config(config), ModelInfo.from_hf_config(spelled)
    fields = ("rope_theta", "rope_type", "rope_scaling", "local_rope_theta", "layer_types")
    assert all(getattr(one, f) == getattr(two, f) for f in fields)


# ---- recipes ---------------------------------------------------------------------------------


def family_recipe(tmp_path: Path, model: Path, quant: str, deploy: str = "") -> Path:
    path = tmp_path / "family.yaml"
    path.write_text(
        f"name: family\nmodel:\n  source: {model}\nquantization: {quant}\n{deploy}"
        "calibration: {dataset: builtin:licenses, num_samples: 8, max_seq_len: 64}\n"
        "report: {num_samples: 4, max_seq_len: 64}\ntargets: [h100-sxm]\noutput: out\n"
    )
    return path


def test_mixtral_compiles_for_the_pytorch_path_and_plans_its_engine(
    tiny_mixtral: Path, tmp_path: Path
) -> None:
    result = CliRunner().invoke(
        main, ["compile", str(family_recipe(tmp_path, tiny_mixtral, "{method: fp8}")), "--json"]
    )
    assert result.exit_code == 0, result.stderr
    target = json.loads(result.stdout)["targets"]["h100-sxm"]
    assert target["pytorch"] == "ready"
    assert target["engine"] == "planned"  # no TensorRT-LLM 1.2 and GPU here to build it
    artifact = Path(json.loads(result.stdout)["artifact"])
    assert check_hf_checkpoint(artifact / "trtllm" / "hf", 1) == []
    serve = (artifact / "engines" / "h100-sxm" / "trtllm-serve.yaml").read_text()
    assert "trtllm-serve trtllm/hf --backend pytorch" in serve


@pytest.mark.parametrize(
    ("fixture", "quant", "why"),
    [
        ("tiny_qwen3_moe", "{method: fp8}", "Qwen3MoeForCausalLM with norm_topk_prob false"),
        ("tiny_mixtral", "{method: gptq, group_size: 64}",
         "W4A16_AWQ on MixtralForCausalLM's experts"),
        ("tiny_phi3", "{method: gptq, group_size: 64}",
         "W4A16_AWQ on Phi3ForCausalLM: modeling_phi3.py Phi3ForCausalLM splits the fused"),
        ("tiny_phi3", "{method: fp8, kv_cache: fp8}", "a FP8 KV cache on Phi3ForCausalLM"),
    ],
)  # fmt: skip
def test_what_the_pytorch_backend_would_run_differently_is_refused(
    fixture: str, quant: str, why: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    # The PyTorch path alone: the engine path takes Phi-3 with these (test_trtllm_engine_families).
    deploy = "deploy: {trtllm_path: pytorch}\n"
    path = family_recipe(tmp_path, request.getfixturevalue(fixture), quant, deploy)
    result = CliRunner().invoke(main, ["validate", str(path)])
    assert result.exit_code == 2
    assert f"TensorRT-LLM's PyTorch backend: {why}" in result.stderr.replace("\n", " ")


def test_qwen3_moe_dense_layers_are_refused_for_the_pytorch_path() -> None:
    from kiln.compiler.trtllm.rules.pytorch import family_problem

    base = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
            "moe_intermediate_size": 32, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "vocab_size": 100, "num_experts": 4,
            "num_experts_per_tok": 2, "norm_topk_prob": True}  # fmt: skip
    assert family_problem(ModelInfo.from_hf_config(base), "FP8", None) is None
    dense = ModelInfo.from_hf_config({**base, "mlp_only_layers": [1]})
    assert "dense layers (1," in (family_problem(dense, "FP8", None) or "")
    stepped = ModelInfo.from_hf_config({**base, "decoder_sparse_step": 2})
    assert "dense layers (0, 2" in (family_problem(stepped, "FP8", None) or "")


def test_float_experts_are_excluded_by_the_module_the_backend_matches(converted) -> None:
    """TensorRT-LLM matches exclude_modules against its own module names, and a layer's
    experts are one fused module there: a float layer of experts must be named as
    `...experts`, per-expert names match nothing; and tp must divide an expert's width."""
    from kiln.compiler.trtllm.rules.pytorch import (
        float_expert_blocks,
        fused_problems,
        hf_linears,
        tp_problems,
    )

    _, hf = converted("mixtral")
    config = json.loads((hf / "config.json").read_text())
    layer0 = {lin.name for lin in hf_linears(config) if lin.name.startswith("model.layers.0.")}
    experts = {n for n in layer0 if ".experts." in n}
    block = "model.layers.0.block_sparse_moe.experts"
    assert float_expert_blocks(config, experts) == [block]
    assert any(block in p for p in fused_problems(config, {"exclude_modules": sorted(experts)}))
    assert fused_problems(config, {"exclude_modules": [*sorted(experts), block]}) == []
    half = sorted(experts)[: len(experts) // 2]
    assert any("not the rest of its fused group" in p for p in fused_problems(
        config, {"exclude_modules": half}))  # fmt: skip
    assert tp_problems(config, "FP8", {}, 2) == []
    narrow = {**config, "intermediate_size": 90}
    assert "90 intermediate rows do not split evenly" in " ".join(tp_problems(narrow, "FP8", {}, 4))


def test_longrope_is_spelled_as_transformers_4s_phi3config_takes_it() -> None:
    """transformers 4's Phi3Config (TensorRT-LLM 1.2's reader) accepts a rope_scaling of
    exactly type, short_factor and long_factor; TensorRT-LLM reads type "longrope"."""
    rope = {"rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [2.0, 4.0],
            "original_max_position_embeddings": 16, "rope_theta": 10000.0}  # fmt: skip
    config = {"architectures": ["Phi3ForCausalLM"], "rope_parameters": rope,
              "max_position_embeddings": 512}  # fmt: skip
    spelled = with_legacy_rope(config)
    assert spelled["rope_scaling"] == {
        "type": "longrope",
        "short_factor": [1.0, 1.5],
        "long_factor": [2.0, 4.0],
    }
    assert (spelled["rope_theta"], spelled["original_max_position_embeddings"]) == (10000.0, 16)
