"""EngineConfig: every knob of the serving engine, validated once when it is built."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from kiln.runtime.base.errors import UsageError

DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")
POLICIES = ("fcfs", "priority")
# Without a budget or a block count, the pool is sized for every sequence at full length,
# capped here so a model with a long context does not grab all memory on a laptop.
DEFAULT_KV_CACHE_BYTES = 1 << 30


@dataclass(slots=True)
class EngineConfig:
    """How the engine schedules, caches and computes.

    `dtype` "auto" is bfloat16 on CPUs that compute bf16 natively (AVX512-BF16 or AMX) and on
    AVX2+FMA CPUs where kiln's bf16-weight kernel loads, float32 on other CPUs and the
    checkpoint's dtype on GPUs (runtime/engine/dtype.py).
    `kv_cache_dtype` "auto" stores K/V in the compute dtype, or in the FP8/INT8 encoding the
    checkpoint names; "bfloat16" halves KV memory traffic on CPU at bf16 precision.
    KV capacity comes from `num_blocks` when given, else from `kv_cache_memory_bytes`, else
    from enough blocks for `max_num_seqs` sequences at `max_model_len` (capped at 1 GiB).
    `long_prefill_token_threshold` (vLLM's name) caps one request's prefill chunk per step,
    so a long prompt leaves room in every step for other requests' decodes and prefills;
    None lets a chunk take all the budget left.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int | None = None
    scheduling_policy: str = "fcfs"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    num_threads: int | None = None

    def __post_init__(self) -> None:
        problems = []
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)} must be >= 1")
        optional = ("num_blocks", "kv_cache_memory_bytes", "max_model_len", "num_threads",
                    "long_prefill_token_threshold")  # fmt: skip
        for name in optional:
            value = getattr(self, name)
            if value is not None and value < 1:
                problems.append(f"{name}={value} must be >= 1 (or None for the default)")
        if self.dtype not in DTYPES:
            problems.append(f"dtype={self.dtype!r} is not one of {', '.join(DTYPES)}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            problems.append(
                f"kv_cache_dtype={self.kv_cache_dtype!r} is not one of {', '.join(KV_CACHE_DTYPES)}"
            )
        if self.scheduling_policy not in POLICIES:
            problems.append(
                f"scheduling_policy={self.scheduling_policy!r} is not one of {', '.join(POLICIES)}"
            )
        if problems:
            raise UsageError("invalid engine config: " + "; ".join(problems))


def engine_config(**options: Any) -> EngineConfig:
    """Build an EngineConfig from keyword options, naming any unknown one."""
    known = {f.name for f in fields(EngineConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise UsageError(
            f"unknown engine option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
        )
    return EngineConfig(**options)
