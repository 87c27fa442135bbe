"""The KV-capacity benchmark's contiguous baseline is measured, not computed."""

from __future__ import annotations

from pathlib import Path

from kiln.runtime.engine.attention import PagedKVCache
from kiln.runtime.engine.loader import read_config
from kiln.runtime.formats.model_info import ModelInfo
from tests.benchmarks.runtime_kv_capacity import contiguous_capacity


def test_the_contiguous_baseline_allocates_a_static_cache_per_sequence(tiny_llama: Path) -> None:
    info = ModelInfo.for_runtime(read_config(tiny_llama), str(tiny_llama))
    per_token = PagedKVCache.bytes_per_block(info.num_layers, 1, info.num_kv_heads,
                                             info.head_dim, 4)  # fmt: skip
    max_len = 64
    budget = int(3.5 * max_len * per_token)  # room for three whole sequences, not four
    prompts = [[5 + i] * (8 + 4 * i) for i in range(6)]  # ragged: left padding in the batch

    fits, allocated = contiguous_capacity(tiny_llama, prompts, budget, max_len, new_tokens=4)

    assert fits == 3
    assert allocated == 3 * max_len * per_token  # what transformers really reserved
