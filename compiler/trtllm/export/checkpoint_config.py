"""The `config.json` of a TensorRT-LLM unified checkpoint, from a Hugging Face config.

Field names are TensorRT-LLM's `PretrainedConfig` (tensorrt_llm/models/modeling_utils.py)
and each family's config class (models/qwen/config.py QWenConfig, models/phi3/config.py
Phi3Config, models/gemma/config.py GemmaConfig, layers/moe.py MoeConfig); `producer` records
where the checkpoint came from, as ModelOpt's writer does (TensorRT-LLM keeps unknown keys as
attributes). The family rules these follow are in compiler/trtllm/rules/engine.py.
"""

from __future__ import annotations

from typing import Any

from kiln.compiler.trtllm.export.source import Source
from kiln.compiler.trtllm.rules.engine import moe_normalization, sliding_pattern
from kiln.runtime.base.versions import kiln_version


def checkpoint_config(
    src: Source,
    algo: str,
    tp: int,
    dtype: str,
    pre_quant: bool,
    exclude: list[str],
    group_size: int | None = None,
) -> dict[str, Any]:
    """config.json of the checkpoint: model shape, rope, mapping and quantization
    (`group_size`: the quantised linears' groups, for the group-wise algorithms)."""
    cfg, info = src.config, src.info
    rope = cfg.get("rope_parameters") or {}
    rope_theta = cfg.get("rope_theta", rope.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or (
        rope if rope.get("rope_type", "default") != "default" else None
    )
    if scaling:
        scaling = {
            ("type" if k == "rope_type" else k): v for k, v in scaling.items() if k != "rope_theta"
        }
    quant: dict[str, Any] = {
        "quant_algo": algo if algo != "NO_QUANT" else None,
        "kv_cache_quant_algo": src.kv_cache_quant_algo,
        "exclude_modules": exclude,
    }
    if algo in ("W4A16_AWQ", "W4A8_AWQ"):
        quant.update(
            group_size=group_size, has_zero_point=not src.symmetric, pre_quant_scale=pre_quant
        )
    if algo == "NVFP4":  # blocks of 16 (quantization/layers.py FP4Linear)
        quant["group_size"] = 16
    family = _family(src, rope_theta)
    if "rotary_scaling" in family:  # the family's own RoPE keys replace the generic ones
        scaling = family.pop("rotary_scaling")
    # layers/moe.py: experts split by tensor parallelism (their width), none by experts.
    moe_mapping = {"moe_tp_size": tp, "moe_ep_size": 1} if info.moe is not None else {}
    return {
        **family,
        "producer": {
            "name": "kiln",
            "version": kiln_version(),
            "source_format": src.fmt,
            "source_quant_algo": src.quant_algo,
        },
        "architecture": info.architecture,
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": info.vocab_size,
        "max_position_embeddings": info.max_position_embeddings,
        "hidden_size": info.hidden_size,
        "num_hidden_layers": info.num_layers,
        "num_attention_heads": info.num_heads,
        "num_key_value_heads": info.num_kv_heads,
        "head_size": info.head_dim,
        "hidden_act": family.pop("hidden_act", cfg.get("hidden_act", "silu")),
        "intermediate_size": family.pop("intermediate_size", info.intermediate_size),
        "norm_epsilon": cfg.get("rms_norm_eps", 1e-6),
        "position_embedding_type": family.pop("position_embedding_type", "rope_gpt_neox"),
        "rotary_base": family.pop("rotary_base", rope_theta),
        "rotary_scaling": scaling,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "share_embedding_table": False,
        "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1, **moe_mapping},
        "quantization": quant,
    }


def _family(src: Source, rope_theta: float) -> dict[str, Any]:
    """The config.json keys of the model's family beyond Llama's (overriding Llama's where
    the family names them: hidden_act, intermediate_size, position_embedding_type,
    rotary_scaling)."""
    info, cfg = src.info, src.config
    arch = info.architecture
    family: dict[str, Any] = {}
    if arch == "Qwen2ForCausalLM":  # models/qwen/config.py QWenConfig
        family = {"qwen_type": "qwen2", "attn_bias": True, "mlp_bias": False}
    if arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        # QWenConfig.from_hugging_face: qwen_type from model_type, attn_bias False for qwen3;
        # models/qwen/model.py QWenDecoderLayer derives qk_layernorm from qwen_type (PR #5650).
        qwen_type = "qwen3_moe" if info.moe is not None else "qwen3"
        family = {"qwen_type": qwen_type, "attn_bias": False, "mlp_bias": False}
    if arch == "Qwen3MoeForCausalLM":  # QWenConfig: the experts' width and no shared expert
        family.update(moe_intermediate_size=info.moe_intermediate_size,
                      moe_shared_expert_intermediate_size=0, mlp_only_layers=[],
                      decoder_sparse_step=1)  # fmt: skip
    if info.moe is not None:  # layers/moe.py MoeConfig (from_dict is cls(**moe))
        family["hidden_act"] = "swiglu"  # gated experts: fc holds up and gate
        family["intermediate_size"] = info.moe_intermediate_size
        family["moe"] = {
            "num_experts": info.num_experts,
            "shared_expert_intermediate_size": 0,
            "top_k": info.num_experts_per_tok,
            "normalization_mode": moe_normalization(info),
            "sparse_mixer_epsilon": 0.01,
            "tp_mode": 0,
            "device_limited_n_group": 0,
            "device_limited_topk_group": 0,
            "device_limited_routed_scaling_factor": 1.0,
        }
    if arch == "Phi3ForCausalLM":
        # models/phi3: MLP with swiglu over the fused fc; rotary_pct for partial rotary;
        # LongRoPE only as position type long_rope with both factor lists present (the
        # model tests for the attribute, so a 4k model must not name them at all).
        family = {"hidden_act": "swiglu", "rotary_pct": info.partial_rotary_factor,
                  "rotary_scaling": None}  # fmt: skip
        if info.rope_type == "longrope":
            scaling = info.rope_scaling or {}
            family.update(
                position_embedding_type="long_rope",
                original_max_position_embeddings=scaling.get(
                    "original_max_position_embeddings",
                    cfg.get("original_max_position_embeddings"),
                ),
                longrope_scaling_short_factors=list(scaling["short_factor"]),
                longrope_scaling_long_factors=list(scaling["long_factor"]),
            )
    if arch == "Gemma3ForCausalLM":
        # models/gemma/config.py GemmaConfig (Gemma3ConfigGroup): gelu is TensorRT-LLM's tanh
        # GELU; the sliding window itself is a runtime setting (max_attention_window).
        family = {
            "hidden_act": "gelu",
            "query_pre_attn_scalar": info.query_pre_attn_scalar or info.head_dim,
            "_sliding_window_pattern": sliding_pattern(info),
            "rope_local_base_freq": info.local_rope_theta or rope_theta,
            "sliding_window": info.sliding_window,
            "final_logit_softcapping": cfg.get("final_logit_softcapping"),
            "inter_layernorms": True,
            "attn_bias": False,
            "mlp_bias": False,
            "rotary_scaling": None,
            "rotary_base": info.rope_theta,
        }
    return family
