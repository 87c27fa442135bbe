"""The `config.json` of a TensorRT-LLM unified checkpoint, from a Hugging Face config.

Field names are TensorRT-LLM's `PretrainedConfig` (tensorrt_llm/models/modeling_utils.py)
for Llama-family decoders; `producer` records where the checkpoint came from, as ModelOpt's
writer does (TensorRT-LLM keeps unknown keys as attributes).
"""

from __future__ import annotations

from typing import Any

from kiln.compiler.trtllm.export.source import Source
from kiln.runtime.base.versions import kiln_version


def checkpoint_config(
    src: Source, algo: str, tp: int, dtype: str, pre_quant: bool, exclude: list[str]
) -> dict[str, Any]:
    """config.json of the checkpoint: model shape, rope, mapping and quantization."""
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
        group = next(
            lin.scheme.group_size for lin in src.linears.values() if lin.scheme.strategy == "group"
        )
        quant.update(group_size=group, has_zero_point=not src.symmetric, pre_quant_scale=pre_quant)
    if algo == "NVFP4":  # blocks of 16 (quantization/layers.py FP4Linear)
        quant["group_size"] = 16
    family: dict[str, Any] = {}
    if info.architecture == "Qwen2ForCausalLM":  # models/qwen/config.py QWenConfig
        family = {"qwen_type": "qwen2", "attn_bias": True, "mlp_bias": False}
    if info.architecture == "Qwen3ForCausalLM":
        # QWenConfig.from_hugging_face: qwen_type from model_type, attn_bias False for qwen3;
        # models/qwen/model.py QWenDecoderLayer derives qk_layernorm from qwen_type (PR #5650).
        family = {"qwen_type": "qwen3", "attn_bias": False, "mlp_bias": False}
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
        "hidden_act": cfg.get("hidden_act", "silu"),
        "intermediate_size": info.intermediate_size,
        "norm_epsilon": cfg.get("rms_norm_eps", 1e-6),
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": rope_theta,
        "rotary_scaling": scaling,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "share_embedding_table": False,
        "mapping": {"world_size": tp, "tp_size": tp, "pp_size": 1},
        "quantization": quant,
    }
