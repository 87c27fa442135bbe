"""`kiln validate` reads the whole checkpoint against its config before any compute: every
tensor the architecture reads, in every layer, with its shape (what transformers would
initialise at random is refused, naming it), no layer beyond num_hidden_layers, and every
config.json value the runtime and exporters read within its range (exit 2 naming config.json,
the key and the value; never "internal error")."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from kiln.compiler.cli.main import main
from tests.prequantized import make_awq_checkpoint, make_gptq_checkpoint

FAMILIES = ["tiny_llama", "tiny_mistral", "tiny_qwen2", "tiny_qwen3", "tiny_phi3", "tiny_gemma3",
            "tiny_mixtral", "tiny_qwen3_moe"]  # fmt: skip


def validate(
    tmp_path: Path, source: Path, command: str = "validate", quant: str = "method: fp8_dynamic"
) -> tuple[int, str]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "recipe.yaml"
    path.write_text(
        f"name: whole\nmodel:\n  source: {source}\nquantization: {{{quant}}}\n"
        f"calibration:\n  dataset: builtin:licenses\n  num_samples: 4\noutput: {tmp_path / 'out'}\n"
    )
    result = CliRunner().invoke(main, [command, str(path)])
    return result.exit_code, result.output.replace("\n", " ")


def edited(model: Path, into: Path, drop: tuple[str, ...] = (), **config: Any) -> Path:
    """A copy of `model` without the tensors named in `drop` (a name, or a prefix ending in
    "."), its config.json updated with `config`."""
    shutil.copytree(model, into)
    weights = into / "model.safetensors"
    tensors = load_file(weights)
    kept = {k: v for k, v in tensors.items() if not any(k == d or k.startswith(d) for d in drop)}
    assert len(kept) < len(tensors) or not drop
    save_file(kept, weights, metadata={"format": "pt"})
    data = json.loads((into / "config.json").read_text())
    (into / "config.json").write_text(json.dumps({**data, **config}))
    return into


@pytest.mark.parametrize("fixture", FAMILIES)
def test_every_familys_own_checkpoint_validates(
    fixture: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    code, out = validate(tmp_path, request.getfixturevalue(fixture))
    assert code == 0, out


def test_a_mixtral_without_one_layers_router_is_refused_before_any_compute(
    tiny_mixtral: Path, tmp_path: Path
) -> None:
    model = edited(tiny_mixtral, tmp_path / "m", ("model.layers.1.block_sparse_moe.gate.weight",))
    code, out = validate(tmp_path, model, "compile")
    assert code == 2, out
    assert "transformers would initialise at random" in out
    assert "model.layers.1: 1 of 19 missing (block_sparse_moe.gate.weight)" in out
    assert f"{model} (model.safetensors)" in out
    assert not (tmp_path / "out").exists()  # nothing loaded, nothing calibrated


def test_a_qwen3_without_q_norm_in_one_layer_is_refused(tiny_qwen3: Path, tmp_path: Path) -> None:
    model = edited(tiny_qwen3, tmp_path / "m", ("model.layers.0.self_attn.q_norm.weight",))
    code, out = validate(tmp_path, model)
    assert code == 2 and "model.layers.0: 1 of 11 missing (self_attn.q_norm.weight)" in out


def test_gemma3s_sandwich_norms_are_required(tiny_gemma3: Path, tmp_path: Path) -> None:
    model = edited(tiny_gemma3, tmp_path / "m", ("model.layers.2.post_feedforward_layernorm.",))
    code, out = validate(tmp_path, model)
    assert code == 2 and "model.layers.2: 1 of 13 missing (post_feedforward_layernorm" in out


def test_missing_experts_are_summarised_per_layer(tiny_qwen3_moe: Path, tmp_path: Path) -> None:
    experts = "model.layers.2.mlp.experts"
    drop = (f"{experts}.0.up_proj.", f"{experts}.1.", f"{experts}.3.down_proj.")
    code, out = validate(tmp_path, edited(tiny_qwen3_moe, tmp_path / "m", drop))
    assert code == 2
    assert "model.layers.2: 5 of 21 missing (mlp.experts.0.up_proj.weight, " in out
    assert "and 2 more)" in out


def test_a_layer_missing_entirely_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    code, out = validate(tmp_path, edited(tiny_llama, tmp_path / "m", ("model.layers.1.",)))
    assert code == 2 and "model.layers.1: the whole layer" in out


def test_layers_the_config_does_not_have_are_refused(tiny_llama: Path, tmp_path: Path) -> None:
    """More layers in config.json than in the weights: the missing run is named; fewer: the
    weights past num_hidden_layers would be skipped by transformers, a shallower model."""
    code, out = validate(tmp_path / "a", edited(tiny_llama, tmp_path / "more", num_hidden_layers=5))
    assert code == 2 and "model.layers.2 to model.layers.4: whole layers" in out
    code, out = validate(tmp_path / "b", edited(tiny_llama, tmp_path / "less", num_hidden_layers=1))
    assert code == 2 and "holds layers 1 past config.json's num_hidden_layers 1" in out


def test_the_lm_head_is_required_unless_tied(tiny_llama: Path, tmp_path: Path) -> None:
    code, out = validate(tmp_path / "a", edited(tiny_llama, tmp_path / "m", ("lm_head.weight",)))
    assert code == 2 and "initialise at random: lm_head.weight" in out
    tied = edited(tiny_llama, tmp_path / "tied", ("lm_head.weight",), tie_word_embeddings=True)
    assert validate(tmp_path / "b", tied)[0] == 0


def fused(mixtral: Path, into: Path, experts: tuple[int, int]) -> Path:
    """`mixtral` as transformers 5 holds it: each layer's sparse block under `mlp`, its
    experts fused (gate_up_proj [experts, 2 x width, hidden], down_proj); layer i keeps the
    first experts[i] of them."""
    shutil.copytree(mixtral, into)
    tensors = load_file(into / "model.safetensors")
    for layer, kept in enumerate(experts):
        old, new = f"model.layers.{layer}.block_sparse_moe", f"model.layers.{layer}.mlp"
        w = {(e, p): tensors.pop(f"{old}.experts.{e}.w{p}.weight") for e in range(4) for p in "123"}
        tensors[f"{new}.gate.weight"] = tensors.pop(f"{old}.gate.weight")
        gate_up = [torch.cat([w[e, "1"], w[e, "3"]]) for e in range(kept)]
        tensors[f"{new}.experts.gate_up_proj"] = torch.stack(gate_up)
        tensors[f"{new}.experts.down_proj"] = torch.stack([w[e, "2"] for e in range(kept)])
    save_file(tensors, into / "model.safetensors", metadata={"format": "pt"})
    return into


def test_transformers_5s_fused_expert_layout_validates(tiny_mixtral: Path, tmp_path: Path):
    code, out = validate(tmp_path / "a", fused(tiny_mixtral, tmp_path / "whole", (4, 4)))
    assert code == 0, out
    code, out = validate(tmp_path / "b", fused(tiny_mixtral, tmp_path / "short", (4, 3)))
    assert code == 2 and "model.layers.1: 3 of 19 missing (block_sparse_moe.experts.3.w1" in out
    assert "model.layers.0" not in out


@pytest.mark.parametrize("kind", ["awq", "gptq"])
def test_pre_quantised_checkpoints_validate_and_a_missing_linear_is_named(
    kind: str, tiny_llama: Path, tmp_path: Path
) -> None:
    """AutoAWQ's and GPTQModel's (sharded, with an index) packed linears count as present."""
    if kind == "awq":
        source = make_awq_checkpoint(tiny_llama, tmp_path / kind).path
    else:
        source = make_gptq_checkpoint(
            tiny_llama, tmp_path / kind, sym=False, checkpoint_format="gptq_v2",
            producer="gptqmodel", shards=2,
        ).path  # fmt: skip
    code, out = validate(tmp_path, source, quant="")  # imported as it is
    assert code == 0, out
    shard = sorted(source.glob("*.safetensors"))[-1]
    tensors = load_file(shard)
    name = next(k for k in tensors if k.endswith("mlp.down_proj.qweight"))
    save_file({k: v for k, v in tensors.items() if k != name}, shard, metadata={"format": "pt"})
    code, out = validate(tmp_path, source, quant="")
    assert code == 2 and "1 of 9 missing (mlp.down_proj.weight)" in out


CONFIGS = {
    "no expert a token": ("tiny_mixtral", {"num_experts_per_tok": 0}, "num_experts_per_tok 0"),
    "more than the experts": ("tiny_mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok 5"),
    "zero experts": ("tiny_mixtral", {"num_local_experts": 0}, "num_local_experts 0"),
    "sparse step 0": ("tiny_qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step 0"),
    "dense layer out of range": ("tiny_qwen3_moe", {"mlp_only_layers": [3]}, "mlp_only_layers [3]"),
    "window 0": ("tiny_mistral", {"sliding_window": 0}, "sliding_window 0"),
    "layer_types too short": (
        "tiny_gemma3", {"layer_types": ["sliding_attention", "full_attention"]},
        "layer_types of 2 entries for num_hidden_layers 3",
    ),
    "unknown layer type": (
        "tiny_gemma3", {"layer_types": ["sliding_attention", "local", "full_attention"]},
        "layer_types[1] 'local'",
    ),
    "more layers than layer_types": (
        "tiny_qwen3", {"num_hidden_layers": 3}, "layer_types of 2 entries for num_hidden_layers 3"
    ),
    "no attention heads": ("tiny_llama", {"num_attention_heads": 0}, "num_attention_heads 0"),
    "integer weights": ("tiny_llama", {"dtype": "int8"}, "dtype 'int8'"),
    "Gemma's pattern 0": (
        "tiny_gemma3", {"layer_types": None, "sliding_window_pattern": 0},
        "sliding_window_pattern 0",
    ),
    "negative epsilon": ("tiny_qwen2", {"rms_norm_eps": -1e-6}, "rms_norm_eps -1e-06"),
    "sliding layers' RoPE base 0": (
        "tiny_gemma3", {"rope_parameters": {"full_attention": {"rope_type": "default"},
                                            "sliding_attention": {"rope_theta": 0}}},
        "rope_parameters.sliding_attention.rope_theta 0",
    ),
    "RoPE base 0": (
        "tiny_llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 0}},
        "rope_parameters.rope_theta 0",
    ),
    "RoPE settings a list": ("tiny_llama", {"rope_parameters": [1, 2]},
                             "rope_parameters is [1, 2], not an object"),
    "RoPE scaling a string": ("tiny_qwen2", {"rope_scaling": "yarn"},
                              'rope_scaling is "yarn", not an object'),
    "architectures a string": ("tiny_llama", {"architectures": "LlamaForCausalLM"},
                               'architectures "LlamaForCausalLM", not a list of class names: '
                               'write ["LlamaForCausalLM"]'),
}  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 256}  # fmt: skip
CONFIGS |= {
    f"llama3 {key} {value}": ("tiny_llama", {"rope_parameters": {**LLAMA3, key: value}}, shown)
    for key, value, shown in [
        ("factor", 0, "rope_parameters.factor 0"),
        ("low_freq_factor", 4.0, "rope_parameters.low_freq_factor 4.0 not below high_freq_factor"),
        ("high_freq_factor", None, "rope_parameters.high_freq_factor None"),
        ("original_max_position_embeddings", 8192,
         "rope_parameters.original_max_position_embeddings 8192"),
    ]
}  # fmt: skip
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 16,
            "long_factor": [2.0] * 16, "original_max_position_embeddings": 256}  # fmt: skip
CONFIGS |= {
    f"LongRoPE {key}": ("tiny_phi3", {"rope_parameters": {**LONGROPE, key: value}}, shown)
    for key, value, shown in [
        ("short_factor", [1.0] * 3, "rope_parameters.short_factor of 3 values"),
        ("long_factor", [2.0] * 15 + [0.0], "rope_parameters.long_factor[15] 0.0"),
        ("long_factor", None, "rope_parameters.long_factor None"),
        ("original_max_position_embeddings", 0,
         "rope_parameters.original_max_position_embeddings 0"),
    ]
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(CONFIGS))
def test_config_values_out_of_range_are_refused_naming_the_key(
    case: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    fixture, config, shown = CONFIGS[case]
    model = edited(request.getfixturevalue(fixture), tmp_path / "m", **config)
    code, out = validate(tmp_path, model)
    assert code == 2, out
    assert f"{model / 'config.json'} has" in out and shown in out
    assert "internal error" not in out


@pytest.mark.parametrize(("text", "shown"), [("[1, 2]", "holds [1, 2]"), ("null", "holds null"),
                                             ("{", "not valid JSON")])  # fmt: skip
def test_a_config_that_is_no_json_object_is_refused_naming_the_file(
    text: str, shown: str, tiny_llama: Path, tmp_path: Path
) -> None:
    model = edited(tiny_llama, tmp_path / "m")
    (model / "config.json").write_text(text)
    code, out = validate(tmp_path, model)
    assert code == 2, out
    assert str(model / "config.json") in out and shown in out
    assert "internal error" not in out and "Traceback" not in out
