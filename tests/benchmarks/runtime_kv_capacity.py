"""KV capacity benchmark: paged KV cache vs contiguous pre-allocation, same memory budget.

A contiguous engine (Hugging Face's static cache, an engine without paging) reserves
`max_model_len` tokens of K and V for every sequence it admits, so a budget of B bytes holds
B // (max_model_len * bytes per token) sequences whatever their lengths. The paged engine
holds each sequence's blocks only as its tokens arrive, wasting at most the last partial
block. This script runs kiln's engine for real under a fixed `kv_cache_memory_bytes` with
mixed prompt lengths, counts the sequences that are running at once (peak over all steps,
and whether any had to be preempted), and prints the ratio to the contiguous count
computed for the same budget and geometry.

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
from kiln.runtime.attention import PagedKVCache
from kiln.runtime.loader import read_config
from kiln.runtime.model_info import ModelInfo
from tests.benchmarks.runtime_serving import make_prompts, smollm2_dir


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
    contiguous = budget // (args.max_model_len * per_token)
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
    print(f"contiguous pre-allocation: {contiguous} sequences fit")
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
    print(f"ratio paged / contiguous: {peak_before_preemption / contiguous:.2f}x (target >= 3x)")


if __name__ == "__main__":
    main()
