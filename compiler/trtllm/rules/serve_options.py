"""The LLM API arguments a `trtllm-serve --config` options file may hold, and their values,
as TensorRT-LLM's `TorchLlmArgs` defines them; `check_serve_options` lists what a file
kiln writes would have refused.
"""

from __future__ import annotations

from typing import Any

from kiln.runtime.formats.trtllm_serve import DRAFT_TARGET

# tensorrt_llm/llmapi/llm_args.py: the LLM API models forbid unknown fields, so each dict
# takes only its class's fields. These are the ones kiln writes (BaseLlmArgs / TorchLlmArgs,
# KvCacheConfig; NGramDecodingConfig and DraftTargetDecodingConfig via
# DecodingBaseConfig.from_dict, whose `speculative_model_dir` is an alias of
# `speculative_model`).
SERVE_KEYS = frozenset(
    {
        "tensor_parallel_size",
        "pipeline_parallel_size",
        "max_batch_size",
        "max_input_len",
        "max_seq_len",
        "max_num_tokens",
        "enable_chunked_prefill",
        "kv_cache_config",
        "speculative_config",
        "disable_overlap_scheduler",
    }
)


KV_CACHE_KEYS = frozenset(
    {"free_gpu_memory_fraction", "enable_block_reuse", "tokens_per_block", "dtype"}
)


KV_CACHE_DTYPES = frozenset({"auto", "fp8"})  # KvCacheConfig.dtype on the PyTorch backend


_DRAFT_KEYS = frozenset({"decoding_type", "max_draft_len", "speculative_model_dir"})
# DraftTarget on 1.2, "Draft_Target" after it (runtime/formats/trtllm_serve.py).
SPECULATIVE_KEYS = {
    **{spelling: _DRAFT_KEYS for spelling in DRAFT_TARGET.values()},
    "NGram": frozenset({"decoding_type", "max_draft_len", "max_matching_ngram_size"}),
}


# llm_args.py `supports_backend`: NGram and DraftTarget decoding run on the PyTorch backend
# only, so an engine built for externally drafted tokens cannot be driven by the LLM API.
SPECULATION_BACKENDS = {kind: frozenset({"pytorch"}) for kind in SPECULATIVE_KEYS}


def check_serve_options(options: dict[str, Any]) -> list[str]:
    """Every rule a trtllm-serve options dict breaks; empty when the LLM API takes it."""
    problems = [f"{k}: not an LLM API argument" for k in sorted(set(options) - SERVE_KEYS)]
    kv = options.get("kv_cache_config") or {}
    problems += [
        f"kv_cache_config.{k}: not a KvCacheConfig field" for k in sorted(set(kv) - KV_CACHE_KEYS)
    ]
    if kv.get("dtype", "auto") not in KV_CACHE_DTYPES:
        problems.append(
            f"kv_cache_config.dtype {kv['dtype']!r}: the PyTorch backend takes auto or fp8"
        )
    spec = options.get("speculative_config")
    if spec is not None:
        kind = spec.get("decoding_type")
        if kind not in SPECULATIVE_KEYS:
            problems.append(f"speculative_config.decoding_type {kind!r}: use "
                            f"{' or '.join(SPECULATIVE_KEYS)}")  # fmt: skip
        else:
            extra = sorted(set(spec) - SPECULATIVE_KEYS[kind])
            problems += [f"speculative_config.{k}: not a {kind} field" for k in extra]
            if int(spec.get("max_draft_len") or 0) < 1:
                problems.append(f"speculative_config.max_draft_len must be > 0 for {kind}")
    return problems
