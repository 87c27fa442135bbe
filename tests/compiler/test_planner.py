"""The capacity planner against published model sizes and by-hand arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kiln.compiler.cli.describe import format_plan
from kiln.compiler.trtllm.capacity import DeploySpec, linear_bytes, plan, tp_valid
from kiln.compiler.trtllm.targets import get_profile
from kiln.quant.schemes import resolve
from kiln.quant.spec import QuantSpec
from kiln.runtime.base.errors import UsageError
from kiln.runtime.formats.model_info import ModelInfo

# Published configs (config.json of meta-llama/Meta-Llama-3-70B and Llama-3.1-8B).
LLAMA_3_70B = ModelInfo.from_hf_config({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 8192, "intermediate_size": 28672,
    "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
})  # fmt: skip
LLAMA_31_8B = ModelInfo.from_hf_config({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
})  # fmt: skip
SMOLLM2_135M = ModelInfo.from_hf_config({
    "architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
    "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True,
})  # fmt: skip

BF16 = QuantSpec()
FP8 = QuantSpec(method="fp8", weight_bits=8, activations="fp8_static")
FP8_KV = QuantSpec(method="fp8", weight_bits=8, activations="fp8_static", kv_cache="fp8")
AWQ = QuantSpec(method="awq", weight_bits=4, group_size=128, symmetric=False)
CTX_8K = DeploySpec(max_seq_len=8192)


def test_llama3_70b_kv_cache_is_2_6_gb_per_8k_request_in_bf16():
    p = plan(LLAMA_3_70B, resolve(BF16), get_profile("h200"), CTX_8K)
    assert p.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    assert p.kv_bytes_per_request == 327_680 * 8192  # 2.68 GB
    assert p.kv_bytes_per_request / 1e9 == pytest.approx(2.68, abs=0.01)


def test_fp8_kv_cache_halves_the_kv_bytes():
    bf16 = plan(LLAMA_3_70B, resolve(FP8), get_profile("h200"), CTX_8K)
    fp8 = plan(LLAMA_3_70B, resolve(FP8_KV), get_profile("h200"), CTX_8K)
    assert fp8.kv_bytes_per_token * 2 == bf16.kv_bytes_per_token
    assert fp8.max_concurrent_sequences >= 2 * bf16.max_concurrent_sequences


def test_llama31_8b_bf16_is_16_gb_and_fits_one_h100():
    p = plan(LLAMA_31_8B, resolve(BF16), get_profile("h100-sxm"), DeploySpec())
    assert p.weight_bytes / 1e9 == pytest.approx(16.06, rel=0.005)  # 8.03B params × 2 B
    assert p.weight_bytes == LLAMA_31_8B.num_parameters * 2
    assert p.fits and p.tp_size == 1 and p.max_concurrent_sequences > 64


def test_llama3_70b_bf16_needs_two_h100s():
    p = plan(LLAMA_3_70B, resolve(BF16), get_profile("h100-sxm"), CTX_8K)
    assert p.weight_bytes / 1e9 == pytest.approx(141.1, rel=0.005)  # 70.55B params × 2 B
    assert p.fits and p.tp_size == 2 and p.num_gpus == 2
    assert any("needs tp=2" in n for n in p.notes)


def test_llama3_70b_bf16_pinned_to_one_h100_does_not_fit_and_says_what_would():
    p = plan(
        LLAMA_3_70B, resolve(BF16), get_profile("h100-sxm"), DeploySpec(max_seq_len=8192, tp_size=1)
    )
    assert not p.fits and p.max_concurrent_sequences == 0
    assert "needs tp=2 (2 × h100-sxm)" in p.suggestions
    assert any(s.startswith("fits with FP8") and s.endswith("tp=1") for s in p.suggestions)


def test_llama3_70b_fp8_fits_one_h200():
    p = plan(LLAMA_3_70B, resolve(FP8), get_profile("h200"), CTX_8K)
    assert p.fits and p.tp_size == 1 and p.max_concurrent_sequences >= 16


def test_w4a16_awq_is_a_quarter_of_bf16_plus_group_scales_and_zeros():
    out, inp = 28672, 8192
    expected = out * inp // 2 + out * (inp // 128) * 2 * 2  # int4 + fp16 scale and zero
    assert linear_bytes(out, inp, "W4A16_AWQ", 128, symmetric=False) == expected
    assert linear_bytes(out, inp, "NO_QUANT", None, symmetric=True) == out * inp * 2
    awq = plan(LLAMA_3_70B, resolve(AWQ), get_profile("h100-sxm"), CTX_8K)
    assert awq.fits and awq.tp_size == 1
    assert 0.25 < awq.weight_bytes / plan(LLAMA_3_70B, resolve(BF16), get_profile("h200"),
                                          CTX_8K).weight_bytes < 0.32  # fmt: skip


def test_tp_splits_weights_and_kv_heads_but_replicates_the_embedding():
    one = plan(LLAMA_3_70B, resolve(BF16), get_profile("h100-sxm"), DeploySpec(tp_size=1))
    four = plan(LLAMA_3_70B, resolve(BF16), get_profile("h100-sxm"), DeploySpec(tp_size=4))
    embedding = 128256 * 8192 * 2
    assert four.weight_bytes == one.weight_bytes
    assert four.weight_bytes_per_gpu == pytest.approx(
        (one.weight_bytes - embedding) / 4 + embedding, rel=0.001)  # fmt: skip
    assert four.kv_bytes_per_token_per_gpu * 4 == one.kv_bytes_per_token_per_gpu


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    info = ModelInfo.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 11008,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 2,
        "vocab_size": 32000})  # fmt: skip
    p = plan(info, resolve(BF16), get_profile("h100-sxm"), DeploySpec(tp_size=8))
    assert p.kv_bytes_per_token_per_gpu == 2 * 32 * 1 * 128 * 2  # one KV head per GPU


def test_tp_must_split_the_heads():
    assert tp_valid(LLAMA_3_70B, 8) and not tp_valid(SMOLLM2_135M, 2)
    with pytest.raises(UsageError) as err:
        plan(SMOLLM2_135M, resolve(BF16), get_profile("l4"), DeploySpec(tp_size=2))
    assert "9 attention heads" in err.value.message and "use 1" in err.value.message


def test_pipeline_parallel_plans_the_busiest_stage():
    p = plan(LLAMA_3_70B, resolve(BF16), get_profile("a100-40gb"), DeploySpec(pp_size=2))
    assert p.fits and p.num_gpus == p.tp_size * 2
    assert p.weight_bytes_per_gpu < p.weight_bytes / p.num_gpus * 1.1


def test_a_smaller_token_budget_is_recommended_when_activations_crowd_out_the_kv_cache():
    p = plan(
        LLAMA_31_8B, resolve(BF16), get_profile("l4"), DeploySpec(max_num_tokens=65536, tp_size=1)
    )
    assert p.fits and p.recommended_max_num_tokens < 65536
    assert any("max_num_tokens ≤" in n for n in p.notes)


def test_kv_limited_plan_suggests_fp8_kv_or_a_shorter_context():
    p = plan(
        LLAMA_31_8B, resolve(BF16), get_profile("l4"), DeploySpec(max_seq_len=131072, tp_size=1)
    )
    assert not p.fits and p.weight_bytes_per_gpu < p.memory_bytes_per_gpu
    assert "kv_cache: fp8 halves the KV cache per request" in p.suggestions
    assert any(s.startswith("or max_seq_len ≤") for s in p.suggestions)


def test_unsupported_scheme_is_noted_in_the_plan():
    p = plan(LLAMA_31_8B, resolve(FP8), get_profile("a100-80gb"), DeploySpec())
    assert any("no FP8 tensor cores" in n for n in p.notes)


def test_recommended_batch_is_the_sequences_that_fit_capped_by_the_deploy_setting():
    p = plan(LLAMA_31_8B, resolve(FP8_KV), get_profile("h200"), DeploySpec(max_batch_size=64))
    assert p.max_concurrent_sequences > 64 and p.recommended_max_batch_size == 64
    q = plan(LLAMA_3_70B, resolve(FP8), get_profile("h200"), DeploySpec(max_seq_len=32768))
    assert q.recommended_max_batch_size == q.max_concurrent_sequences < 256


def test_cost_per_million_output_tokens():
    deploy = DeploySpec(tp_size=2, gpu_price_per_hour=3.0, expected_output_tokens_per_s=2500)
    p = plan(LLAMA_3_70B, resolve(FP8), get_profile("h100-sxm"), deploy)
    assert p.cost_per_million_output_tokens == pytest.approx(2 * 3.0 / (2500 * 3600) * 1e6)
    assert (
        plan(LLAMA_3_70B, resolve(FP8), get_profile("h200"), CTX_8K).cost_per_million_output_tokens
        is None
    )


def test_decode_roofline_is_bandwidth_over_bytes_read_per_step():
    p = plan(LLAMA_31_8B, resolve(BF16), get_profile("h100-sxm"), DeploySpec())
    embedding = 128256 * 4096 * 2
    read = p.weight_bytes_per_gpu - embedding + p.kv_bytes_per_token_per_gpu * 2048
    assert p.decode_tokens_per_s_bound == pytest.approx(3350e9 / read)
    fp8 = plan(LLAMA_31_8B, resolve(FP8), get_profile("h100-sxm"), DeploySpec())
    assert fp8.decode_tokens_per_s_bound > 1.5 * p.decode_tokens_per_s_bound


def test_deploy_spec_rejects_an_input_longer_than_the_sequence():
    with pytest.raises(UsageError) as err:
        DeploySpec(max_seq_len=1024, max_input_len=2048)
    assert "max_input_len" in err.value.message


def test_plan_of_a_real_tiny_checkpoint_is_json_and_a_table(tiny_llama: Path):
    config = json.loads((tiny_llama / "config.json").read_text())
    info = ModelInfo.from_hf_config(config)
    p = plan(info, resolve(BF16), get_profile("l4"), DeploySpec(max_seq_len=256))
    data = json.loads(json.dumps(p.to_dict()))
    assert data["fits"] and data["num_gpus"] == 1 and data["deploy"]["max_seq_len"] == 256
    assert data["weight_bytes"] == info.num_parameters * 2
    table = format_plan(p)
    assert "l4 × 1" in table and "fits" in table and "NO_QUANT" in table
