"""TensorRT-LLM checkpoint export of llm-compressor checkpoints, proven by reading it back."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kiln.compiler.trtllm.export.decode import decode_checkpoint, read_checkpoint
from kiln.compiler.trtllm.export.source import Source, read_source
from kiln.compiler.trtllm.export.writer import _Walk, export_checkpoint
from kiln.compiler.trtllm.rules.checkpoint import CHECKPOINT_ALGO
from kiln.quant.quantize import quantize
from kiln.quant.schemes import resolve
from kiln.quant.spec import CalibrationSpec, QuantSpec
from kiln.runtime.base.errors import UsageError
from kiln.runtime.formats.safetensors_writer import plan

CALIBRATION = CalibrationSpec(num_samples=8, max_seq_len=64)
SPECS = {
    "none": QuantSpec(),
    "fp8_kv": QuantSpec(method="fp8", weight_bits=8, activations="fp8_static", kv_cache="fp8"),
    "awq": QuantSpec(method="awq", weight_bits=4, group_size=64, symmetric=False),
    "gptq": QuantSpec(method="gptq", weight_bits=4, group_size=64),
    "w8a16": QuantSpec(method="gptq", weight_bits=8),
    "sq_int8_kv": QuantSpec(
        method="smoothquant", weight_bits=8, activations="int8_dynamic", kv_cache="int8"
    ),
    "sq_static": QuantSpec(method="smoothquant", weight_bits=8, activations="int8_static"),
}
MODES = list(SPECS)
HEADS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, VOCAB = 4, 2, 32, 128, 256, 512  # tiny_llama


@pytest.fixture(scope="module")
def quantised(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """mode → directory of tiny_llama quantised by kiln's quantiser (made once, on demand)."""
    made: dict[str, Path] = {}

    def get(mode: str) -> Path:
        if mode not in made:
            out = tmp_path_factory.mktemp(f"q-{mode}")
            quantize(tiny_llama, resolve(SPECS[mode]), CALIBRATION, out)
            made[mode] = out
        return made[mode]

    return get


@pytest.fixture(scope="module")
def exported(quantised, tmp_path_factory) -> Callable[[str, int], Path]:
    """(mode, tp) → exported TensorRT-LLM checkpoint directory."""
    made: dict[tuple[str, int], Path] = {}

    def get(mode: str, tp: int = 1) -> Path:
        if (mode, tp) not in made:
            out = tmp_path_factory.mktemp(f"trt-{mode}-tp{tp}")
            export_checkpoint(quantised(mode), out, tp_size=tp)
            made[mode, tp] = out
        return made[mode, tp]

    return get


def reference_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    """The quantiser's dequantised weights, decompressed by transformers + compressed-tensors."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    config = json.loads((model_dir / "config.json").read_text())
    kwargs = {}
    if "quantization_config" in config:
        kwargs["quantization_config"] = CompressedTensorsConfig(run_compressed=False)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, **kwargs)
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def max_rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("mode", MODES)
def test_decoded_checkpoint_carries_the_quantisers_dequantised_weights(mode, quantised, exported):
    reference = reference_weights(quantised(mode))
    decoded = decode_checkpoint(exported(mode))
    weights = {k: v for k, v in decoded.items() if k.endswith(".weight")}
    assert set(weights) == {k for k in reference if k.endswith(".weight")}
    for name, tensor in weights.items():
        fused_fp8 = mode == "fp8_kv" and name.split(".")[-2] in ("q_proj", "k_proj", "v_proj")
        # bf16 storage of floats and group scales moves values by < 2^-8; q/k/v re-quantised
        # to one FP8 scale move by at most one FP8 step (2^-3 of the value).
        bound = 2**-3 if fused_fp8 else 2**-7
        assert max_rel_error(tensor, reference[name]) < bound, name


def test_fp8_and_int8_kv_cache_scale_is_the_larger_of_k_and_v(quantised, exported):
    for mode in ("fp8_kv", "sq_int8_kv"):
        decoded = decode_checkpoint(exported(mode))
        with safe_open(str(quantised(mode) / "model.safetensors"), "pt") as f:
            for layer in range(2):
                k = f.get_tensor(f"model.layers.{layer}.self_attn.k_scale")
                v = f.get_tensor(f"model.layers.{layer}.self_attn.v_scale")
                got = decoded[f"model.layers.{layer}.self_attn.kv_scale"]
                assert torch.equal(got, torch.maximum(k, v).reshape(()).float())


@pytest.mark.parametrize("mode", ["fp8_kv", "awq", "gptq", "w8a16", "sq_int8_kv", "sq_static"])
def test_tp2_shards_reassemble_to_the_tp1_weights(mode, exported):
    one, two = decode_checkpoint(exported(mode, 1)), decode_checkpoint(exported(mode, 2))
    assert one.keys() == two.keys()
    assert all(torch.equal(one[k], two[k]) for k in one)


def test_tp2_ranks_hold_half_the_heads_columns_and_vocab(exported):
    config, ranks = read_checkpoint(exported("awq", 2))
    assert config["mapping"] == {"world_size": 2, "tp_size": 2, "pp_size": 1}
    for rank in ranks:
        qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM // 2
        assert rank["transformer.layers.0.attention.qkv.weight"].shape == (qkv_rows // 2, HIDDEN)
        assert rank["transformer.layers.0.mlp.proj.weights_scaling_factor"].shape == (HIDDEN, 2)
        assert rank["transformer.layers.0.mlp.fc.zero"].shape == (HIDDEN // 64, INTER // 2)
        assert rank["lm_head.weight"].shape == (VOCAB // 2, HIDDEN)
        assert rank["transformer.vocab_embedding.weight"].shape == (VOCAB, HIDDEN)


def test_tp_beyond_the_kv_heads_replicates_them(quantised, exported, tmp_path):
    export_checkpoint(quantised("fp8_kv"), tmp_path, tp_size=4)
    _, ranks = read_checkpoint(tmp_path)
    rows = [r["transformer.layers.0.attention.qkv.weight"].shape[0] for r in ranks]
    assert rows == [3 * HEAD_DIM] * 4  # one q head and one (shared) k and v head each
    decoded, whole = decode_checkpoint(tmp_path), decode_checkpoint(exported("fp8_kv"))
    assert all(torch.equal(decoded[k], whole[k]) for k in whole)


def test_tp_that_cuts_a_quantisation_group_is_refused(quantised, tmp_path):
    with pytest.raises(UsageError) as err:  # o_proj: 128 inputs / 4 = 32 < group 64
        export_checkpoint(quantised("awq"), tmp_path, tp_size=4)
    assert "group of 64" in err.value.message


def test_config_describes_model_mapping_and_quantisation(tiny_llama, exported):
    config, _ = read_checkpoint(exported("awq"))
    hf = json.loads((tiny_llama / "config.json").read_text())
    assert config["architecture"] == "LlamaForCausalLM" and config["dtype"] == "bfloat16"
    assert config["logits_dtype"] == "float32"
    assert config["position_embedding_type"] == "rope_gpt_neox"
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (2, KV_HEADS)
    assert config["rotary_base"] == hf.get(
        "rope_theta", hf.get("rope_parameters", {}).get("rope_theta")
    )
    assert config["quantization"] == {
        "quant_algo": "W4A16_AWQ",
        "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head"],
        "group_size": 64,
        "has_zero_point": True,
        "pre_quant_scale": False,
    }


def test_gptq_is_written_in_the_gpu_independent_awq_layout(exported):
    config, ranks = read_checkpoint(exported("gptq"))
    assert config["quantization"]["quant_algo"] == "W4A16_AWQ"
    assert config["producer"]["source_quant_algo"] == "W4A16_GPTQ"
    assert config["quantization"]["has_zero_point"] is False
    weight = ranks[0]["transformer.layers.0.attention.dense.weight"]
    assert weight.dtype == torch.int8 and weight.shape == (HIDDEN // 2, HIDDEN)


def test_fp8_layout_and_kv_cache_algo(exported):
    config, (rank,) = read_checkpoint(exported("fp8_kv"))
    assert config["quantization"]["quant_algo"] == "FP8"
    assert config["quantization"]["kv_cache_quant_algo"] == "FP8"
    prefix = "transformer.layers.1.attention.qkv"
    assert rank[f"{prefix}.weight"].dtype == torch.float8_e4m3fn
    assert rank[f"{prefix}.weights_scaling_factor"].shape == (1,)
    assert rank[f"{prefix}.activation_scaling_factor"].dtype == torch.float32
    assert rank["lm_head.weight"].dtype == torch.bfloat16


def test_smoothquant_static_and_dynamic_use_their_own_layers(exported):
    static, (s_rank,) = read_checkpoint(exported("sq_static"))
    dynamic, (d_rank,) = read_checkpoint(exported("sq_int8_kv"))
    assert static["quantization"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL"
    assert s_rank["transformer.layers.0.mlp.fc.weights_scaling_factor"].shape == (INTER,)
    assert "transformer.layers.0.mlp.fc.activation_scaling_factor" in s_rank
    assert dynamic["quantization"]["quant_algo"] == "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN"
    assert dynamic["quantization"]["kv_cache_quant_algo"] == "INT8"
    assert d_rank["transformer.layers.0.mlp.fc.per_channel_scale"].shape == (1, INTER)
    assert d_rank["transformer.layers.0.mlp.proj.smoother"].shape == (1, INTER)
    assert "transformer.layers.0.input_layernorm.scale_to_int" in d_rank


def test_w8a16_ships_dequantised_weights_for_trtllm_build_to_quantise(exported):
    config, (rank,) = read_checkpoint(exported("w8a16"))
    assert config["quantization"]["quant_algo"] == "W8A16"
    assert rank["transformer.layers.0.mlp.fc.weight"].dtype == torch.bfloat16


def test_float_checkpoint_exports_without_quantisation(exported):
    config, _ = read_checkpoint(exported("none"))
    assert config["quantization"]["quant_algo"] is None
    assert config["quantization"]["exclude_modules"] == []


def test_modes_without_a_portable_layout_are_refused(tiny_llama, tmp_path):
    spec = QuantSpec(method="gptq", weight_bits=8, group_size=64)
    quantize(tiny_llama, resolve(spec), CALIBRATION, tmp_path / "q")
    with pytest.raises(UsageError) as err:
        export_checkpoint(tmp_path / "q", tmp_path / "trt")
    assert "W8A16_GPTQ" in err.value.message and "group_size: null" in err.value.message


def test_mistral_exports(tiny_mistral, tmp_path):
    export_checkpoint(tiny_mistral, tmp_path / "mistral", dtype="float16")
    config, _ = read_checkpoint(tmp_path / "mistral")
    assert config["architecture"] == "MistralForCausalLM"
    decoded = decode_checkpoint(tmp_path / "mistral")
    reference = reference_weights(tiny_mistral)
    assert all(max_rel_error(decoded[k], reference[k]) < 2**-10 for k in decoded)


@pytest.fixture(scope="module")
def qwen2_with_biases(tiny_qwen2, tmp_path_factory) -> Path:
    """tiny_qwen2 with random (not zero) q/k/v biases, so that carrying them shows."""
    import shutil

    from safetensors.torch import load_file, save_file

    model = tmp_path_factory.mktemp("qwen2-biases") / "model"
    shutil.copytree(tiny_qwen2, model)
    tensors = load_file(str(model / "model.safetensors"))
    generator = torch.Generator().manual_seed(0)
    for name, value in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = torch.randn(value.shape, generator=generator)
    save_file(tensors, str(model / "model.safetensors"), metadata={"format": "pt"})
    return model


@pytest.mark.parametrize("tp", [1, 2])
def test_qwen2_exports_its_qkv_biases(qwen2_with_biases, tmp_path, tp):
    tiny_qwen2 = qwen2_with_biases
    export_checkpoint(tiny_qwen2, tmp_path / "qwen2", dtype="float16", tp_size=tp)
    config, ranks = read_checkpoint(tmp_path / "qwen2")
    assert config["architecture"] == "Qwen2ForCausalLM"
    assert (config["qwen_type"], config["attn_bias"], config["mlp_bias"]) == ("qwen2", True, False)
    assert "transformer.layers.0.attention.qkv.bias" in ranks[0]
    assert "transformer.layers.0.attention.dense.bias" not in ranks[0]
    decoded = decode_checkpoint(tmp_path / "qwen2")
    reference = reference_weights(tiny_qwen2)
    assert "model.layers.0.self_attn.k_proj.bias" in decoded
    assert all(max_rel_error(decoded[k], reference[k]) < 2**-10 for k in decoded)


def _walk(model_dir: Path, tp: int) -> _Walk:
    """The export's walk of `model_dir`, as export_checkpoint makes it."""

    src = read_source(model_dir)
    algo = CHECKPOINT_ALGO[src.quant_algo]
    pre_quant = algo == "W4A8_AWQ" or (algo == "W4A16_AWQ" and src.pre_quant_scales)
    return _Walk(src, algo, tp, torch.bfloat16, pre_quant)


@pytest.mark.parametrize(("mode", "tp"), [("fp8_kv", 1), ("fp8_kv", 2), ("gptq", 2),
                                          ("awq", 1), ("sq_int8_kv", 1), ("none", 1)])  # fmt: skip
def test_the_plan_from_one_layer_is_the_plan_of_every_layer(
    mode: str, tp: int, quantised: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rank files' plan walks each distinct decoder layer once (tiny_llama's are alike:
    one) and names every other layer's tensors from it: the same plan, file by file and name
    by name in order, as walking the whole model."""
    walk = _walk(quantised(mode), tp)
    full = plan(walk.tensors())
    read: list[int] = []
    real = Source.layer
    monkeypatch.setattr(Source, "layer", lambda self, i: read.append(i) or real(self, i))
    planned = walk.plan()
    assert read == [0]
    assert list(planned) == list(full)
    for file in full:
        assert list(planned[file].items()) == list(full[file].items())


def test_a_layer_unlike_the_others_is_walked_for_its_plan(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Layer 0's down_proj left in float: its stored tensors differ, so the plan walks it and
    one of the layers alike, and the export is whole."""
    spec = QuantSpec(method="gptq", weight_bits=4, group_size=64,
                     ignore=("lm_head", r"re:model\.layers\.0\.mlp\.down_proj$"))  # fmt: skip
    quantize(tiny_llama, resolve(spec), CALIBRATION, tmp_path / "q")
    walk = _walk(tmp_path / "q", 1)
    full = plan(walk.tensors())
    read: list[int] = []
    real = Source.layer
    monkeypatch.setattr(Source, "layer", lambda self, i: read.append(i) or real(self, i))
    assert walk.plan() == full and read == [0, 1]
    monkeypatch.undo()
    export_checkpoint(tmp_path / "q", tmp_path / "trt")
    _, (rank,) = read_checkpoint(tmp_path / "trt")
    assert rank["transformer.layers.0.mlp.proj.weight"].dtype == torch.bfloat16
    assert rank["transformer.layers.1.mlp.proj.weight"].dtype == torch.int8
