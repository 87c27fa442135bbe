"""Decode and prefill speed by compute dtype, in one process: float32, bf16 as the runtime
ran it before its bf16 kernels (plain F.linear on bf16 weights, gathered attention), and bf16
now (oneDNN-packed weights where the CPU computes bf16 natively, single rows on kiln's
bf16-weight kernel there; that kernel alone where the CPU has AVX2 without native bf16).
`--dtype auto` is whichever of float32 and bf16 now this table favours on the CPU it ran
on; the CPU heads the output.

    PYTHONPATH=. python tests/benchmarks/runtime_dtype.py --threads 1 --rounds 2 [--model DIR]
        [--random]

SmolLM2-135M-Instruct (runtime_serving.smollm2_dir) or the checkpoint `--model` names;
`--random`: random weights of that checkpoint's shape (its config.json and tokenizer alone,
e.g. on a machine the weights cannot reach; every request ignores EOS, so only the greedy
LM-head screen's share depends on the values). A 128-token prompt. Single stream:
ms per decoded token; batch: the median decode step with 32 sequences; prefill: one
128-token prompt. Times are the process's CPU time (time.process_time), which on a shared
host moves far less than wall time with one thread; with more threads it adds the threads
up. The engines run interleaved, round by round, so the ratios compare like with like. On a
CPU whose oneDNN computes bf16, "bf16 now" runs single rows on kiln's bf16 kernel (with AMX:
up to 128 rows on kiln's AMX kernel) and more on oneDNN's packed weights; more engines run
every row count on oneDNN ("bf16 oneDNN only"), or on kiln's kernel ("bf16 kiln kernel"),
and with AMX single rows on kiln's panels, the rest on oneDNN ("bf16 panels for 1 row",
what the runtime did before its AMX kernel).
"""

from __future__ import annotations

import argparse
import itertools
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import kiln.runtime.engine.attention as attention
import kiln.runtime.engine.layers.dense as dense
import kiln.runtime.engine.layers.linear as linear
from kiln.runtime import Engine, SamplingParams
from kiln.runtime.engine import native
from tests.benchmarks.cpu_comparison import machine
from tests.benchmarks.runtime_serving import smollm2_dir


def random_checkpoint(source: Path) -> Path:
    """A checkpoint of `source`'s config with random bf16 weights (seed 0), tokenizer copied."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(source)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    out = Path(tempfile.mkdtemp(prefix="kiln-random-"))
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (source / name).is_file():
            shutil.copy(source / name, out / name)
    return out


def build(
    path: Path,
    dtype: str,
    before: bool = False,
    onednn: bool = True,
    one_row: bool = True,
    amx: bool = True,
) -> Engine:
    """An engine; `before`: bf16 without packed weights, kiln's bf16 kernel or the native
    decode kernel; `onednn=False`: bf16 on kiln's bf16 kernel even where oneDNN runs bf16;
    `one_row=False`: where oneDNN runs bf16, few rows on it too (no panels or AMX tiles
    beside, and no pairs on CPUs with AVX512-BF16); `amx=False`: single rows on kiln's panels
    even where the CPU has AMX."""
    attention.NATIVE_DECODE = not before
    packed_bf16 = not before and onednn
    dense.PACKED_DTYPES = (torch.float32, torch.bfloat16) if packed_bf16 else (torch.float32,)
    dense.BF16_PANELS = not before
    dense.ONE_ROW_PANELS = one_row
    dense.AMX_LINEAR = amx
    dense.DPBF16_LINEAR = one_row and packed_bf16
    try:
        return Engine.from_pretrained(path, max_num_seqs=32, max_model_len=300, dtype=dtype)
    finally:
        attention.NATIVE_DECODE = True
        dense.PACKED_DTYPES = (torch.float32, torch.bfloat16)
        dense.BF16_PANELS = dense.ONE_ROW_PANELS = dense.AMX_LINEAR = dense.DPBF16_LINEAR = True


def single(engine: Engine, tokens: int) -> float:
    """CPU ms per decoded token of one request (after its first two steps)."""
    params = SamplingParams(max_tokens=tokens + 2, temperature=0, ignore_eos=True)
    engine.add_request(list(range(1000, 1128)), params)
    engine.step()
    engine.step()
    began = time.process_time()
    while engine.has_unfinished_requests():
        engine.step()
    return (time.process_time() - began) / tokens * 1000


def batch(engine: Engine, concurrency: int = 32, tokens: int = 6) -> float:
    """Median CPU ms of a decode step with `concurrency` sequences."""
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i in range(concurrency):
        engine.add_request(list(range(1000 + i, 1128 + i)), params)
    steps = []
    while engine.has_unfinished_requests():
        began = time.process_time()
        out = engine.step()
        if len(out) == concurrency:
            steps.append(time.process_time() - began)
    return statistics.median(steps) * 1000


_prompts = itertools.count()


def prefill(engine: Engine, tokens: int = 128) -> float:
    """CPU ms of one `tokens`-token prompt's prefill (and its first token). Each call's prompt
    is new to the engine: a repeated one is served from the prefix cache, all but its last
    block."""
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    start = 3000 + next(_prompts) * tokens
    engine.add_request(list(range(start, start + tokens)), params)
    began = time.process_time()
    while engine.has_unfinished_requests():
        engine.step()
    return (time.process_time() - began) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--model", type=Path, help="a checkpoint directory (default: SmolLM2)")
    parser.add_argument("--random", action="store_true", help="random weights of its shape")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    path = args.model or smollm2_dir()
    if args.random:
        path = random_checkpoint(path)
    engines = {
        "fp32": build(path, "float32"),
        "bf16 before": build(path, "bfloat16", before=True),
        "bf16 now": build(path, "bfloat16"),
    }
    if linear.onednn_runs_bf16() and native.avx2_kernels_available():
        engines["bf16 oneDNN only"] = build(path, "bfloat16", one_row=False)
        engines["bf16 kiln kernel"] = build(path, "bfloat16", onednn=False)
        if native.amx_kernels_available():
            engines["bf16 panels for 1 row"] = build(path, "bfloat16", amx=False)
    if args.random:
        shutil.rmtree(path)  # the engines hold their weights
    for engine in engines.values():
        single(engine, 4)  # warm-up
    weights = "random weights" if args.random else "its weights"
    print(f"machine: {machine()}; {args.threads} thread(s); {path.name}, {weights}", flush=True)
    results: dict[str, tuple[list[float], ...]] = {k: ([], [], []) for k in engines}
    for r in range(args.rounds):
        for name, engine in engines.items():
            results[name][0].append(single(engine, args.tokens))
            results[name][1].append(batch(engine))
            results[name][2].append(prefill(engine))
        row = "  ".join(
            f"{n}: {results[n][0][-1]:.1f} ms/token, c=32 step {results[n][1][-1]:.0f} ms, "
            f"prefill {results[n][2][-1]:.0f} ms"
            for n in engines
        )
        print(f"round {r}: {row}", flush=True)
    base = [min(m) for m in results["fp32"]]
    for name, measured in results.items():
        singles, batches, prefills = (min(m) for m in measured)
        print(
            f"{name}: {1000 / singles:.1f} tok/s single stream ({base[0] / singles:.2f}x fp32), "
            f"c=32 decode step {batches:.0f} ms ({base[1] / batches:.2f}x fp32), "
            f"128-token prefill {prefills:.0f} ms ({base[2] / prefills:.2f}x fp32)"
        )
    for name, engine in engines.items():
        screen = engine.runner.model.greedy_head
        if screen is not None:
            print(
                f"{name}: greedy LM-head screen decided {screen.screened} steps, "
                f"ran the full head for {screen.fallbacks}"
            )


if __name__ == "__main__":
    main()
