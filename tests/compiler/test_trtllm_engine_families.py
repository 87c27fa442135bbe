"""TensorRT-LLM 1.2 engine checkpoints of Phi-3, Gemma 3, Mixtral and Qwen3-MoE: each loads
by the rules of its model class (compiler/trtllm/rules/checkpoint.py `check_checkpoint`), reads
back to the quantiser's own weights, lays out what is the family's own (Phi-3's fused [up;
gate] fc, Gemma 3's offset norms and layer pattern, the experts stacked behind a float32
router), and what the family's engine model cannot run is refused before calibration.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from kiln.compiler.cli.main import main
from kiln.compiler.trtllm.export.decode import decode_checkpoint
from kiln.compiler.trtllm.export.writer import export_checkpoint
from kiln.compiler.trtllm.rules.checkpoint import check_checkpoint
from kiln.compiler.trtllm.rules.engine import MOE_NONE, MOE_RENORMALIZE, moe_normalization
from kiln.quant.quantize import quantize
from kiln.quant.schemes import resolve
from kiln.quant.spec import CalibrationSpec, QuantSpec
from kiln.runtime.base.errors import UsageError
from kiln.runtime.formats.checkpoint import open_checkpoint
from kiln.runtime.formats.model_info import ModelInfo
from kiln.runtime.formats.weights import effective_weight
from tests.compiler.trtllm_recipes import quantised_per_mode
from tests.tiny_models import make_tiny_model

CALIBRATION = CalibrationSpec(num_samples=8, max_seq_len=64)
SPECS = {
    "none": QuantSpec(),
    "fp8_kv": QuantSpec(method="fp8", weight_bits=8, activations="fp8_static", kv_cache="fp8"),
    "awq": QuantSpec(method="awq", weight_bits=4, group_size=64, symmetric=False),
    "w8a16": QuantSpec(method="gptq", weight_bits=8),
}
# Gemma 3 as its 1B checkpoint is: no RoPE scaling (TensorRT-LLM's gemma model would scale
# the local layers too), two sliding layers then a global one.
GEMMA3_1B_LIKE = {
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
    "query_pre_attn_scalar": 48,
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    },
}
CASES = [
    ("phi3", "none", 1), ("phi3", "fp8_kv", 2), ("phi3", "awq", 2), ("phi3", "w8a16", 1),
    ("gemma3", "none", 2), ("gemma3", "fp8_kv", 1), ("gemma3", "awq", 2),
    ("mixtral", "none", 2), ("mixtral", "fp8_kv", 1), ("mixtral", "fp8_kv", 2),
    ("mixtral", "w8a16", 2), ("qwen3_moe", "fp8_kv", 2),
]  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory, tiny_phi3, tiny_mixtral) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("engine-families")
    return {
        "phi3": tiny_phi3,
        "mixtral": tiny_mixtral,
        "gemma3": make_tiny_model(root / "gemma3", arch="gemma3_text", num_layers=3,
                                  tie_word_embeddings=True, **GEMMA3_1B_LIKE),
        "qwen3_moe": make_tiny_model(root / "qwen3-moe", arch="qwen3_moe", norm_topk_prob=True),
    }  # fmt: skip


@pytest.fixture(scope="module")
def quantised(models, tmp_path_factory) -> Callable[[str, str], Path]:
    return quantised_per_mode(tmp_path_factory, models, SPECS, CALIBRATION)


@pytest.fixture(scope="module")
def exported(quantised, tmp_path_factory) -> Callable[[str, str, int], Path]:
    made: dict[tuple[str, str, int], Path] = {}

    def get(family: str, mode: str, tp: int) -> Path:
        if (family, mode, tp) not in made:
            out = tmp_path_factory.mktemp(f"trt-{family}-{mode}-tp{tp}")
            export_checkpoint(quantised(family, mode), out, tp_size=tp)
            made[family, mode, tp] = out
        return made[family, mode, tp]

    return get


def stored_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every linear's weight as the quantised checkpoint stores it (dequantised, float32),
    Phi-3's fused projections split as the engine's modules hold them."""
    ckpt = open_checkpoint(model_dir)
    info = ModelInfo.from_hf_config(ckpt.config)
    out = {}
    for i in range(info.num_layers):
        for name in info.layer_linears(i):
            w = effective_weight(ckpt.linear(f"model.layers.{i}.{name}"), torch.float32)
            prefix = f"model.layers.{i}"
            if name == "self_attn.qkv_proj":
                q, k, v = w.split(
                    [
                        n * info.head_dim
                        for n in (info.num_heads, info.num_kv_heads, info.num_kv_heads)
                    ]
                )
                names = [f"{prefix}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj")]
                out.update(zip(names, (q, k, v), strict=True))
            elif name == "mlp.gate_up_proj":
                gate, up = w.chunk(2)
                names = [f"{prefix}.mlp.{p}.weight" for p in ("gate_proj", "up_proj")]
                out.update(zip(names, (gate, up), strict=True))
            else:
                out[f"{prefix}.{name}.weight"] = w
    return out


@pytest.mark.parametrize(("family", "mode", "tp"), CASES)
def test_each_familys_checkpoint_loads_and_reads_back_to_the_quantisers_weights(
    family: str, mode: str, tp: int, quantised, exported
) -> None:
    ckpt = exported(family, mode, tp)
    assert check_checkpoint(ckpt) == []
    decoded = decode_checkpoint(ckpt)
    stored = stored_weights(quantised(family, mode))
    assert set(stored) <= set(decoded)
    for name, want in stored.items():
        got = decoded[name]
        # A router is written in float32 as stored; bf16 storage moves floats and group scales
        # by < 2^-8; linears fused into one FP8 GEMM (q/k/v, Phi-3's and each expert's up and
        # gate) are re-quantised to one scale: at most one FP8 step (2^-3 of the value).
        fused = mode == "fp8_kv" and name.split(".")[-2] in (
            "q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3",
        )  # fmt: skip
        bound = 0.0 if name.endswith(".gate.weight") else 2**-3 if fused else 2**-7
        error = float((got - want).abs().max() / want.abs().max())
        assert error <= bound, (name, error)


def test_phi3s_fc_holds_each_ranks_up_rows_then_its_gate_rows(models, exported) -> None:
    """models/phi3: one MLP fc with swiglu over [up; gate], no mlp.gate; at tp 2 each rank
    holds its own half of each, so swiglu on a rank's fc output pairs the right rows."""
    config = json.loads((exported("phi3", "none", 1) / "config.json").read_text())
    assert config["architecture"] == "Phi3ForCausalLM" and config["hidden_act"] == "swiglu"
    assert config["position_embedding_type"] == "rope_gpt_neox" and config["rotary_pct"] == 1.0
    assert "longrope_scaling_short_factors" not in config  # the model tests for the key
    gate, up = load_file(str(models["phi3"] / "model.safetensors"))[
        "model.layers.1.mlp.gate_up_proj.weight"
    ].chunk(2)
    ckpt = exported("phi3", "awq", 2)
    assert check_checkpoint(ckpt) == []
    for r in range(2):
        rank = load_file(str(exported("phi3", "none", 2) / f"rank{r}.safetensors"))
        assert "transformer.layers.1.mlp.gate.weight" not in rank
        fc, rows = rank["transformer.layers.1.mlp.fc.weight"], slice(128 * r, 128 * (r + 1))
        assert torch.equal(fc[:128], up[rows].to(torch.bfloat16))
        assert torch.equal(fc[128:], gate[rows].to(torch.bfloat16))


def test_phi3s_longrope_is_written_as_the_long_rope_position_type(tmp_path: Path) -> None:
    half = 16
    rope = {"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [1.5 + 0.5 * i for i in range(half)],
            "original_max_position_embeddings": 16, "rope_theta": 10000.0}  # fmt: skip
    model = make_tiny_model(tmp_path / "phi3-longrope", arch="phi3", rope_parameters=rope,
                            original_max_position_embeddings=16)  # fmt: skip
    export_checkpoint(model, tmp_path / "trt")
    config = json.loads((tmp_path / "trt" / "config.json").read_text())
    assert config["position_embedding_type"] == "long_rope"
    assert config["original_max_position_embeddings"] == 16
    assert config["longrope_scaling_short_factors"] == pytest.approx(rope["short_factor"])
    assert config["longrope_scaling_long_factors"] == pytest.approx(rope["long_factor"])
    assert config["rotary_scaling"] is None


def test_gemma3s_norms_are_stored_plus_one_and_its_layer_pattern_written(models, exported) -> None:
    """models/gemma/convert.py adds one to every norm (TensorRT-LLM's RmsNorm is x·w);
    GemmaConfig reads _sliding_window_pattern, rope_local_base_freq and query_pre_attn_scalar."""
    ckpt = exported("gemma3", "none", 2)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architecture"] == "Gemma3ForCausalLM" and config["hidden_act"] == "gelu"
    assert config["_sliding_window_pattern"] == 3  # layers 0 and 1 slide, layer 2 is global
    assert (config["rotary_base"], config["rope_local_base_freq"]) == (1e6, 1e4)
    assert config["query_pre_attn_scalar"] == 48 and config["head_size"] == 32
    assert config["inter_layernorms"] is True and config["rotary_scaling"] is None
    hf = load_file(str(models["gemma3"] / "model.safetensors"))
    rank = load_file(str(ckpt / "rank1.safetensors"))
    trt, hf_layer = "transformer.layers.2", "model.layers.2"
    pairs = {
        "transformer.ln_f.weight": "model.norm.weight",
        f"{trt}.post_layernorm.weight": f"{hf_layer}.post_attention_layernorm.weight",
        f"{trt}.attention.q_layernorm.weight": f"{hf_layer}.self_attn.q_norm.weight",
        **{f"{trt}.{n}.weight": f"{hf_layer}.{n}.weight"
           for n in ("pre_feedforward_layernorm", "post_feedforward_layernorm")},
    }  # fmt: skip
    for stored, name in pairs.items():
        want = (hf[name].float() + 1).to(torch.bfloat16)
        assert torch.equal(rank[stored], want), stored


def test_moe_experts_stack_up_then_gate_behind_a_float32_router(models, exported) -> None:
    """layers/moe.py: router (experts, hidden) float32, whole on every rank; fc (experts,
    2 × width / tp, hidden) with each rank's w3 rows then its w1 rows; proj (experts, hidden,
    width / tp); MoeConfig renormalising as Mixtral does."""
    ckpt = exported("mixtral", "none", 2)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["moe"]["num_experts"] == 4 and config["moe"]["top_k"] == 2
    assert config["moe"]["normalization_mode"] == MOE_RENORMALIZE
    assert config["hidden_act"] == "swiglu" and config["mapping"]["moe_tp_size"] == 2
    hf = load_file(str(models["mixtral"] / "model.safetensors"))
    prefix = "model.layers.1.block_sparse_moe"
    for r in range(2):
        rank = load_file(str(ckpt / f"rank{r}.safetensors"))
        router = rank["transformer.layers.1.mlp.router.weight"]
        assert router.dtype == torch.float32 and torch.equal(router, hf[f"{prefix}.gate.weight"])
        fc = rank["transformer.layers.1.mlp.fc.weight"]
        assert fc.shape == (4, 2 * 128, 128)
        rows = slice(128 * r, 128 * (r + 1))
        for e in range(4):
            up, gate = (hf[f"{prefix}.experts.{e}.{w}.weight"][rows].to(torch.bfloat16)
                        for w in ("w3", "w1"))  # fmt: skip
            assert torch.equal(fc[e, :128], up) and torch.equal(fc[e, 128:], gate)
        assert rank["transformer.layers.1.mlp.proj.weight"].shape == (4, 128, 128)


def test_fp8_experts_keep_one_weight_scale_each_and_the_router_stays_excluded(exported) -> None:
    ckpt = exported("qwen3_moe", "fp8_kv", 2)
    config = json.loads((ckpt / "config.json").read_text())
    assert config["qwen_type"] == "qwen3_moe" and config["moe_intermediate_size"] == 128
    assert config["moe"]["normalization_mode"] == MOE_RENORMALIZE  # norm_topk_prob true
    assert "transformer.layers.0.mlp.router" in config["quantization"]["exclude_modules"]
    rank = load_file(str(ckpt / "rank0.safetensors"))
    assert rank["transformer.layers.0.mlp.fc.weight"].dtype == torch.float8_e4m3fn
    assert rank["transformer.layers.0.mlp.fc.weights_scaling_factor"].shape == (4, 1)
    assert rank["transformer.layers.0.mlp.proj.activation_scaling_factor"].shape == (1,)
    assert rank["transformer.layers.0.attention.q_layernorm.weight"].shape == (32,)


def test_qwen3_moe_without_renormalisation_routes_with_the_softmax_weights() -> None:
    info = ModelInfo.from_hf_config({
        "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 128, "intermediate_size": 256,
        "moe_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 512, "num_experts": 4,
        "num_experts_per_tok": 2, "norm_topk_prob": False,
    })  # fmt: skip
    assert moe_normalization(info) == MOE_NONE


def test_a_checkpoint_with_some_experts_float_is_refused_by_name(models, tmp_path: Path) -> None:
    spec = QuantSpec(method="fp8", weight_bits=8, activations="fp8_static",
                     ignore=("lm_head", "re:.*layers\\.0\\..*experts\\.1\\..*"))  # fmt: skip
    quantize(models["mixtral"], resolve(spec), CALIBRATION, tmp_path / "q")
    with pytest.raises(UsageError, match=r"layer 0: experts \[1\] are float"):
        export_checkpoint(tmp_path / "q", tmp_path / "trt")
    assert not (tmp_path / "trt" / "config.json").exists()


def engine_recipe(tmp_path: Path, model: Path, quant: str) -> Path:
    path = tmp_path / "engine.yaml"
    path.write_text(
        f"name: engine\nmodel:\n  source: {model}\nquantization: {quant}\n"
        "deploy: {trtllm_path: engine}\n"
        "calibration: {dataset: builtin:licenses, num_samples: 8, max_seq_len: 64}\n"
        "report: {num_samples: 4, max_seq_len: 64}\ntargets: [h100-sxm]\noutput: out\n"
    )
    return path


@pytest.mark.parametrize(
    ("fixture", "quant", "why"),
    [
        ("tiny_mixtral", "{method: awq}", "W4A16_AWQ on the experts"),
        ("tiny_qwen3_moe", "{method: fp8}", "dense layers 1 (mlp_only_layers"),
        ("tiny_gemma3", "{method: fp8}", "applies one rotary_scaling to the local and the global"),
        ("tiny_phi3", "{method: fp8_dynamic}", "fp8_rowwise_quantize layout of Phi-3"),
        ("tiny_qwen3", "{method: fp8_dynamic}", "swaps attention and norms for layers without the"),
    ],
)
def test_what_a_familys_engine_model_cannot_run_is_refused_before_calibration(
    fixture: str, quant: str, why: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    path = engine_recipe(tmp_path, request.getfixturevalue(fixture), quant)
    result = CliRunner().invoke(main, ["compile", str(path)])
    assert result.exit_code == 2, result.output
    assert why in result.stderr.replace("\n", " ")
    assert not (tmp_path / "out" / ".kiln-cache" / "quantize").exists()


def test_gemma3_compiles_for_the_engine_path_with_its_attention_windows(models, tmp_path) -> None:
    """The engine of a sliding-window model is planned with the per-layer windows it must be
    served with (a runtime setting in TensorRT-LLM 1.2)."""
    path = engine_recipe(tmp_path, models["gemma3"], "{method: fp8}")
    result = CliRunner().invoke(main, ["compile", str(path), "--json"])
    assert result.exit_code == 0, result.stderr
    out = json.loads(result.stdout)
    assert out["targets"]["h100-sxm"]["engine"] == "planned"
    artifact = Path(out["artifact"])
    assert check_checkpoint(artifact / "trtllm" / "tp1") == []
    script = (artifact / "engines" / "h100-sxm" / "build.sh").read_text()
    assert re.search(r"max_attention_window \[8, 8, \d+\]", script), script
