"""Prefix-caching benchmark: time to first token with a shared 512-token system prompt.

Every request is the same system prompt followed by its own short user turn. With
automatic prefix caching the system prompt's full blocks are computed once and later
requests prefill only their own tokens; without it every request prefills everything.
Requests run one at a time (TTFT without queueing), on two engines over the same weights.

    PYTHONPATH=. python tests/benchmarks/runtime_prefix_cache.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kiln.runtime import Engine, SamplingParams
from tests.benchmarks.runtime_serving import make_prompts, smollm2_dir


def ttft(engine: Engine, prompt: list[int]) -> float:
    """Seconds from submitting one request to its first token."""
    began = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while engine.has_unfinished_requests():
        if engine.step():
            return time.perf_counter() - began
    raise AssertionError("the request finished without a token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="default: SmolLM2-135M-Instruct fp32")
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=32)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model_dir or smollm2_dir()
    max_len = args.system_tokens + args.user_tokens + 16
    cached = Engine.from_pretrained(model_dir, max_model_len=max_len, max_num_seqs=4)
    uncached = Engine.from_pretrained(
        model_dir,
        tokenizer=cached.tokenizer,
        max_model_len=max_len,
        max_num_seqs=4,
        enable_prefix_caching=False,
    )
    texts = make_prompts(cached.tokenizer, args.requests + 2, args.system_tokens)
    system = texts[0]
    users = [t[: args.user_tokens] for t in texts[1:]]
    ttft(cached, system + users[-1])  # warm-up, and puts the system prompt in the cache
    ttft(uncached, system + users[-1])

    times: dict[str, list[float]] = {"cached": [], "uncached": []}
    for user in users[: args.requests]:  # interleaved: the box is shared, load drifts
        times["cached"].append(ttft(cached, system + user))
        times["uncached"].append(ttft(uncached, system + user))
    hit = cached.stats()
    p50 = {name: statistics.median(values) for name, values in times.items()}
    print(
        f"{model_dir.name}: system prompt {args.system_tokens} tokens + user "
        f"{args.user_tokens}, {args.requests} requests, threads {args.threads}"
    )
    print(
        f"TTFT p50 uncached {p50['uncached'] * 1000:.0f} ms, cached {p50['cached'] * 1000:.0f} ms"
    )
    print(
        f"speed-up {p50['uncached'] / p50['cached']:.1f}x; prefix cache hit rate "
        f"{hit.prefix_cache_hits}/{hit.prefix_cache_queries} tokens"
    )


if __name__ == "__main__":
    main()
