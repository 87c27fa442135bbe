"""KV capacity benchmark: paged KV cache vs contiguous pre-allocation, same memory budget.

A contiguous engine (Hugging Face's static cache, an engine without paging) reserves
`max_model_len` tokens of K and V for every sequence it admits, so a budget of B bytes holds
B // (max_model_len * bytes per token) sequences whatever their lengths. The paged engine
holds each sequence's blocks only as its tokens arrive, wasting at most the last partial
block. Both sides are measured, on the same prompts and budget: the contiguous baseline is
transformers' `generate` with a `StaticCache` of max_model_len, run on 1, 2, 3, ...
sequences until the cache it allocated no longer fits the budget; kiln's engine runs under
`kv_cache_memory_bytes` = the budget, and the script counts the sequences running at once
(peak over all steps, and before any had to be preempted). It prints the ratio of the two.

    PYTHONPATH=. python tests/benchmarks/runtime_kv_capacity.py --threads 2
    PYTHONPATH=. python tests/benchmarks/runtime_kv_capacity.py --model-dir /tmp/rt/smol
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from kiln.runtime import Engine, SamplingParams
from kiln.runtime.engine.attention import PagedKVCache
from kiln.runtime.engine.loader import read_config
from kiln.runtime.formats.model_info import ModelInfo
from tests.benchmarks.runtime_serving import make_prompts, smollm2_dir


def contiguous_capacity(
    model_dir: Path, prompts: list[list[int]], budget: int, max_len: int, new_tokens: int
) -> tuple[int, int]:
    """The contiguous engine, measured: transformers' `generate` with a `StaticCache` of
    `max_len` tokens per sequence on the first 1, 2, 3, ... prompts (left-padded), until the
    cache it allocated exceeds `budget`. Returns (sequences that fit, their cache's bytes)."""
    from transformers import AutoModelForCausalLM, StaticCache

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    fits = used = 0
    for n in range(1, len(prompts) + 1):
        batch = prompts[:n]
        width = max(map(len, batch))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        cache = StaticCache(config=model.config, max_cache_len=max_len)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, past_key_values=cache, do_sample=False,
                           max_new_tokens=new_tokens, pad_token_id=0)  # fmt: skip
        allocated = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
        if allocated > budget:
            break
        fits, used = n, allocated
    return fits, used


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="default: SmolLM2-135M-Instruct fp32")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--contiguous-seqs",
        type=int,
        default=4,
        help="budget = this many sequences pre-allocated at max_model_len",
    )
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--min-prompt", type=int, default=32)
    parser.add_argument("--max-prompt", type=int, default=480)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model_dir or smollm2_dir()

    config = ModelInfo.for_runtime(read_config(model_dir), str(model_dir))
    itemsize = 4  # float32 K and V: the CPU default (dtype auto)
    per_token = PagedKVCache.bytes_per_block(
        config.num_layers, 1, config.num_kv_heads, config.head_dim, itemsize
    )
    budget = args.contiguous_seqs * args.max_model_len * per_token
    engine = Engine.from_pretrained(
        model_dir,
        dtype="float32",
        kv_cache_memory_bytes=budget,
        block_size=args.block_size,
        max_model_len=args.max_model_len,
        max_num_seqs=args.requests,
        enable_prefix_caching=False,  # distinct prompts; count blocks, not cache hits
    )

    rng = random.Random(0)
    lengths = [rng.randint(args.min_prompt, args.max_prompt) for _ in range(args.requests)]
    pool = make_prompts(engine.tokenizer, args.requests, args.max_prompt)
    prompts = [p[:n] for p, n in zip(pool, lengths, strict=True)]
    contiguous, contiguous_bytes = contiguous_capacity(
        model_dir, prompts, budget, args.max_model_len, args.output_tokens
    )
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    peak = peak_before_preemption = 0
    began = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        stats = engine.stats()
        peak = max(peak, stats.num_requests_running)
        if stats.num_preemptions == 0:
            peak_before_preemption = peak
    wall = time.perf_counter() - began
    stats = engine.stats()

    mean_len = sum(lengths) / len(lengths) + args.output_tokens
    print(
        f"{model_dir.name}: KV budget {budget / 2**20:.1f} MiB ({engine.num_blocks} blocks of "
        f"{args.block_size}), max_model_len {args.max_model_len}, {args.requests} requests, "
        f"prompts {args.min_prompt}-{args.max_prompt} tokens (mean {mean_len:.0f} with "
        f"{args.output_tokens} output)"
    )
    print(
        f"contiguous (measured, transformers StaticCache): {contiguous} sequences fit, their "
        f"cache allocated {contiguous_bytes / 2**20:.1f} MiB"
    )
    blocks = [-(-(n + args.output_tokens) // args.block_size) for n in lengths]
    print(
        f"paged (arithmetic): {engine.num_blocks} blocks / {sum(blocks) / len(blocks):.1f} "
        f"blocks per finished sequence = {engine.num_blocks * len(blocks) / sum(blocks):.1f} "
        "sequences"
    )
    print(
        f"paged (measured): peak {peak} sequences running at once, {peak_before_preemption} "
        f"before the first preemption, {stats.num_preemptions} preemptions, {wall:.1f} s"
    )
    ratio = peak_before_preemption / contiguous if contiguous else float("inf")
    print(f"ratio paged / contiguous: {ratio:.2f}x (target >= 3x)")


if __name__ == "__main__":
    main()
