"""Which model families kiln's TensorRT-LLM 1.2 checkpoint export writes, and what each
family's engine model cannot run, judged from config.json and the recipe before calibration.

Read from TensorRT-LLM's 1.2-era sources (none of its code is used or copied; no library
states these rules, so this module is ours):
- models/__init__.py `MODEL_MAP`: Llama, Mistral and Mixtral build as LLaMAForCausalLM;
  Qwen2, Qwen3 and Qwen3-MoE as QWenForCausalLM; Phi3ForCausalLM as Phi3ForCausalLM;
  Gemma3ForCausalLM as GemmaForCausalLM.
- layers/moe.py `MixtureOfExperts`: the experts of a layer are one module (`mlp`) with the
  float32 router (`mlp.router`, "Routing is sensitive", never quantised) and the stacked
  expert GEMMs `mlp.fc` / `mlp.proj`; its quantised forms are FP8 per tensor (one weight scale
  per expert, one activation scale per GEMM), the weight-only modes trtllm-build quantises
  from float, and group-wise int4, whose expert layout kiln does not write; "MOE Does not
  support FP8 rowwise quantize", and quantization/quantize.py `smooth_quantize_plugin` has
  no MoE layer (SmoothQuant never reaches experts).
- quantization/quantize.py `smooth_quantize_plugin` and `fp8_rowwise_quantize` swap every
  RmsNorm but ln_f for SmoothQuantRmsNorm / Fp8RowwiseRmsNorm, which hand the next GEMM int8
  or FP8, and the attention for quantization/layers.py SmoothQuantAttention /
  Fp8RowwiseAttention, which build no q/k norm and take hidden_size / heads channels a head:
  the per-head q/k norms (Qwen3, Qwen3-MoE, Gemma 3) would be dropped or emit quantised values
  where float is read.
- models/qwen/model.py builds every layer of a qwen3_moe model sparse (mlp_only_layers and
  decoder_sparse_step are not read).
- models/phi3/model.py: attention has hidden_size / heads channels a head (config head_size is
  not read); rotary_scaling is never read, LongRoPE only as the `long_rope` position type with
  the mscale sqrt(1 + ln(max / original) / ln(original)).
- models/gemma/model.py: sliding layers are those with (layer + 1) % _sliding_window_pattern
  != 0, rotating with rope_local_base_freq, and one `rotary_scaling` is applied to both the
  local and the global RoPE tables.
"""

from __future__ import annotations

import math

from kiln.compiler.trtllm.rules.other_servers import serves_elsewhere
from kiln.quant.registry import Problem
from kiln.runtime.formats.model_info import ModelInfo

# The families kiln's TensorRT-LLM 1.2 checkpoint export writes → the model class MODEL_MAP
# builds them with.
ENGINE_ARCHITECTURES = {
    "LlamaForCausalLM": "models/llama LLaMAForCausalLM",
    "MistralForCausalLM": "models/llama LLaMAForCausalLM",
    "Qwen2ForCausalLM": "models/qwen QWenForCausalLM",
    "Qwen3ForCausalLM": "models/qwen QWenForCausalLM",
    "Phi3ForCausalLM": "models/phi3 Phi3ForCausalLM",
    "Gemma3ForCausalLM": "models/gemma GemmaForCausalLM",
    "MixtralForCausalLM": "models/llama LLaMAForCausalLM with layers/moe.py MixtureOfExperts",
    "Qwen3MoeForCausalLM": "models/qwen QWenForCausalLM (qwen3_moe) with layers/moe.py MOE",
}
# The algos kiln writes expert GEMMs in (float, FP8 per tensor, and float weights that
# trtllm-build quantises per channel).
MOE_ENGINE_ALGOS = frozenset({"NO_QUANT", "FP8", "W8A16", "W4A16"})
# Algos whose TensorRT-LLM layers replace the norms (and whole MLP blocks), not only linears.
NORM_SWAPPING = {
    "W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN": "smooth_quantize_plugin",
    "FP8_PER_CHANNEL_PER_TOKEN": "fp8_rowwise_quantize",
}
# layers/moe.py MoeConfig.ExpertScaleNormalizationMode
MOE_NONE, MOE_RENORMALIZE = 0, 1


def engine_problem(info: ModelInfo, algo: str, kv_algo: str | None = None) -> Problem | None:
    """Why kiln's TensorRT-LLM 1.2 engine path cannot carry this model with QuantAlgo `algo`
    (None where it can)."""
    del kv_algo  # every family's attention takes the FP8 and INT8 KV caches kiln writes
    arch = info.architecture
    fix = "deploy.trtllm_path: pytorch (trtllm-serve loads the Hugging Face checkpoint)"
    if arch not in ENGINE_ARCHITECTURES:
        known = ", ".join(ENGINE_ARCHITECTURES)
        return Problem("deploy.trtllm_path",
                       f"{arch}: kiln's TensorRT-LLM 1.2 checkpoint export writes {known}",
                       serves_elsewhere(info, algo))  # fmt: skip
    why = _family_problem(info, algo)
    return None if why is None else Problem("deploy.trtllm_path", f"{arch}: {why}", fix)


def _family_problem(info: ModelInfo, algo: str) -> str | None:
    arch, where = info.architecture, ENGINE_ARCHITECTURES[info.architecture]
    if info.moe is not None and algo not in MOE_ENGINE_ALGOS:
        return (f"{algo} on the experts: {where} takes FP8 per tensor or weight-only experts "
                f"from kiln ({', '.join(sorted(MOE_ENGINE_ALGOS))}); TensorRT-LLM has no "
                "SmoothQuant or FP8 rowwise MoE, and kiln does not write its group-wise int4 "
                "expert layout")  # fmt: skip
    if info.qk_norm and algo in NORM_SWAPPING:
        return (
            f"{algo}: {NORM_SWAPPING[algo]} swaps attention and norms for layers without the "
            "per-head q/k norms; use method fp8 or smoothquant with activations: int8_static"
        )
    if arch == "Qwen3MoeForCausalLM" and info.dense_layers:
        dense = ", ".join(map(str, info.dense_layers))
        return (f"dense layers {dense} (mlp_only_layers / decoder_sparse_step): {where} builds "
                "every layer as mixture of experts")  # fmt: skip
    if arch == "Phi3ForCausalLM":
        return _phi3_problem(info, algo, where)
    if arch == "Gemma3ForCausalLM":
        return _gemma3_problem(info, algo, where)
    return None


def _phi3_problem(info: ModelInfo, algo: str, where: str) -> str | None:
    if info.head_dim * info.num_heads != info.hidden_size:
        return (
            f"head_dim {info.head_dim} x {info.num_heads} heads != hidden size "
            f"{info.hidden_size}: {where} gives each head hidden_size / heads channels"
        )
    if algo in NORM_SWAPPING:
        return (
            f"{algo}: kiln does not write the {NORM_SWAPPING[algo]} layout of Phi-3's fused "
            "gate/up MLP; use method fp8 or smoothquant with activations: int8_static"
        )
    if info.rope_type not in ("default", "longrope"):
        return f"rope_type {info.rope_type}: {where} reads no rotary_scaling"
    if info.rope_type == "longrope":
        scaling = info.rope_scaling or {}
        original = scaling.get("original_max_position_embeddings") or info.config.get(
            "original_max_position_embeddings"
        )
        factor = scaling.get("attention_factor")
        if original and factor is not None:
            ratio = info.max_position_embeddings / original
            derived = math.sqrt(1 + math.log(ratio) / math.log(original)) if ratio > 1 else 1.0
            if not math.isclose(float(factor), derived, rel_tol=1e-6):
                return (f"LongRoPE attention_factor {factor}: {where} derives "
                        f"{derived:.6f} from the context lengths")  # fmt: skip
    return None


def _gemma3_problem(info: ModelInfo, algo: str, where: str) -> str | None:
    del algo
    if info.rope_scaling:
        return (
            f"rope scaling {info.rope_type} on the global layers: {where} applies one "
            "rotary_scaling to the local and the global RoPE tables alike"
        )
    if sliding_pattern(info) is None:
        return (
            f"layer_types {list(info.layer_types)}: {where} slides every layer but each "
            "_sliding_window_pattern-th, a pattern these layers do not follow"
        )
    return None


def sliding_pattern(info: ModelInfo) -> int | None:
    """Gemma 3's `_sliding_window_pattern` (every pattern-th layer global) that reproduces
    `info.layer_types`; None where no such pattern does."""
    types = info.layer_types or ("full_attention",) * info.num_layers
    for pattern in range(1, info.num_layers + 2):
        want = tuple(
            "sliding_attention" if (i + 1) % pattern else "full_attention"
            for i in range(info.num_layers)
        )
        if want == types:
            return pattern
    return None


def moe_normalization(info: ModelInfo) -> int:
    """MoeConfig.normalization_mode reproducing the model's routing: renormalised top-k
    weights (Mixtral; Qwen3-MoE with norm_topk_prob) or the softmax's own (NONE)."""
    layout = info.moe
    renormalise = layout is not None and (
        layout.normalize if layout.normalize is not None else info.norm_topk_prob
    )
    return MOE_RENORMALIZE if renormalise else MOE_NONE
