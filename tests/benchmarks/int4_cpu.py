"""W4A16 decode on a CPU: torch's int4pack kernel vs kiln's int4 kernel, per layer and per token.

    PYTHONPATH=. python tests/benchmarks/int4_cpu.py --rows 1,2,4,8,32 [--artifact W4A16_DIR]

One thread, CPU time (time.process_time). For each of SmolLM2-135M's projection shapes at
the demo's group size (64) and row count: `Int4Linear` on torch's
`_weight_int4pack_mm_for_cpu` (the path where kiln's kernels do not load) and on kiln's int4
kernel (runtime/csrc/int4_linear.cpp; the runtime's path on CPUs with AVX2 and FMA), each
cycling through enough copies of its weight (256 MB, more than a server CPU's last-level
cache) that a call never finds its weight in the caches, as in a decode step.
With `--artifact` (a W4A16 artifact, e.g. the demo's) it also decodes one greedy stream on
each path, CPU ms per generated token (a 129-token run less a 1-token one, after the same
prompt). The two paths alternate within each round and the best round counts, so a busy
neighbour moves both; the CPU and its flags head the output, and ratios compare columns of
one run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kiln.runtime import kernels, native
from kiln.runtime.kernels import Int4Linear, make_linear
from kiln.runtime.linear import LinearWeights, WeightScheme
from tests.benchmarks.cpu_comparison import machine
from tests.benchmarks.runtime_linear import SHAPES, STREAM_BYTES

PATHS = {"torch int4pack": False, "kiln int4": True}  # name: whether kiln's kernel runs
GROUP = 64


def take_kiln(on_kiln: bool) -> None:
    """Layers and engines built from here on decode on kiln's kernel (True) or torch's."""
    kernels.int4_on_kiln = lambda device: on_kiln


def int4_layer(n: int, k: int, on_kiln: bool) -> Int4Linear:
    take_kiln(on_kiln)
    codes = torch.randint(-8, 8, (n, k), dtype=torch.int8)
    scheme = WeightScheme("int", 4, "group", GROUP)
    weights = LinearWeights(scheme, codes, torch.rand(n, k // GROUP) * 0.01 + 0.001)
    layer = make_linear([weights], torch.bfloat16, torch.device("cpu"))
    assert isinstance(layer, Int4Linear)
    return layer


def best_of(calls: dict[str, Callable[[], float]], rounds: int) -> dict[str, float]:
    """Each callable returns a duration; they alternate within a round, best round kept."""
    best = dict.fromkeys(calls, float("inf"))
    for _ in range(rounds):
        for name, call in calls.items():
            best[name] = min(best[name], call())
    return best


def layer_ms(layers: list[Int4Linear], x: torch.Tensor, calls: int) -> Callable[[], float]:
    def run() -> float:
        began = time.process_time()
        for i in range(calls):
            layers[i % len(layers)](x)
        return (time.process_time() - began) / calls * 1000

    run()  # warm
    return run


def decode_ms(artifact: str, on_kiln: bool) -> Callable[[], float]:
    from kiln.runtime.engine import Engine
    from kiln.runtime.sampling import SamplingParams

    take_kiln(on_kiln)
    engine = Engine.load(artifact)
    prompt = "the river stone garden window " * 25  # ~126 tokens

    def tokens(count: int) -> float:
        params = SamplingParams(max_tokens=count, temperature=0.0, ignore_eos=True)
        began = time.process_time()
        engine.generate([prompt], params)
        return time.process_time() - began

    def run() -> float:
        return (tokens(129) - tokens(1)) / 128 * 1000

    tokens(8)  # warm
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,32", help="row counts (tokens per call)")
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--artifact", help="a W4A16 artifact to decode end to end")
    args = parser.parse_args()
    if not native.avx2_kernels_available():
        raise SystemExit("kiln's int4 kernel needs an x86 CPU with AVX2 and FMA and a compiler")
    torch.set_num_threads(1)
    print(f"machine: {machine()}; 1 thread; CPU ms (best of {args.rounds} alternating rounds)")
    names = list(PATHS)
    print(f"| layer | rows | {' | '.join(names)} | {names[0]} / {names[1]} |")
    print("|---|---|---|---|---|")
    for name, (n, k, _) in SHAPES.items():
        if name == "lm_head":  # the demo keeps its LM head in bf16
            continue
        copies = max(1, STREAM_BYTES // (n * k // 2))
        layers = {path: [int4_layer(n, k, on) for _ in range(copies)] for path, on in PATHS.items()}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k).to(torch.bfloat16)
            ms = best_of(
                {path: layer_ms(layers[path], x, args.calls) for path in PATHS}, args.rounds
            )
            cells = " | ".join(f"{ms[p]:.3f}" for p in names)
            print(f"| {name} {n}x{k} | {rows} | {cells} | {ms[names[0]] / ms[names[1]]:.2f}x |")
    if args.artifact:
        print(f"\nsingle-stream decode of {args.artifact}, CPU ms per token:")
        runs = {path: decode_ms(args.artifact, on) for path, on in PATHS.items()}
        ms = best_of(runs, args.rounds)
        for path in names:
            print(f"  {path}: {ms[path]:.1f} ms/token ({1000 / ms[path]:.1f} tok/s)")
        print(f"  {names[0]} / {names[1]}: {ms[names[0]] / ms[names[1]]:.2f}x")


if __name__ == "__main__":
    main()
