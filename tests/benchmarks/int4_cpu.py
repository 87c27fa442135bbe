"""W4A16 on a CPU: torch's int4pack kernel, kiln's int4 kernel and, where the CPU has AMX,
kiln's int4 tiles on the tile unit; per layer and end to end.

    PYTHONPATH=. python tests/benchmarks/int4_cpu.py --rows 1,2,4,8,32 [--artifact W4A16_DIR]

One thread, CPU time (time.process_time). For each of SmolLM2-135M's projection shapes at
the demo's group size (64) and row count: `Int4Linear` on torch's
`_weight_int4pack_mm_for_cpu` (the path where kiln's kernels do not load), on kiln's int4
kernel (runtime/engine/native/csrc/int4_linear.cpp; the runtime's path on CPUs with AVX2 and FMA,
and below `Int4Linear.AMX_ROWS` rows with AMX) and, where kiln's AMX kernels load, with
`int4_amx_linear` from AMX_ROWS rows up (runtime/engine/native/csrc/amx_linear.cpp: the runtime's
path there), each cycling through enough copies of its weight (256 MB, more than a server CPU's
last-level cache) that a call never finds its weight in the caches, as in a decode step. With
`--artifact` (a W4A16 artifact, e.g. the demo's) it also decodes greedy streams on each path
(`--streams`, 1 and 32 by default), CPU ms per decode step (a 129-token run less a 1-token one,
after the same prompts). The paths alternate within each round and the best round counts, so a busy
neighbour moves them all; the CPU and its flags head the output, and the ratios (each path's time
over the last path's) compare columns of one run. A W8A16 artifact given as --artifact is measured
the same way: its first two paths are then the same (`_weight_int8pack_mm`), the last runs
`int8_amx_linear`.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kiln.runtime.engine import native
from kiln.runtime.engine.layers import int4
from kiln.runtime.engine.layers.int4 import Int4Linear
from kiln.runtime.engine.layers.kernels import make_linear
from kiln.runtime.formats.weights import LinearWeights, WeightScheme
from tests.benchmarks.cpu_comparison import machine
from tests.benchmarks.runtime_linear import SHAPES, STREAM_BYTES

# name: (whether kiln's int4 kernel runs, whether the tile unit runs from AMX_ROWS rows)
PATHS = {"torch int4pack": (False, False), "kiln int4": (True, False)}
AMX_PATH = {"kiln int4 + AMX": (True, True)}
GROUP = 64
_ON_AMX = int4.on_amx_tiles


def take_kiln(path: tuple[bool, bool]) -> None:
    """Layers and engines built from here on run `path`."""
    on_kiln, on_amx = path
    int4.int4_on_kiln = lambda device: on_kiln
    int4.on_amx_tiles = lambda device, dtype: on_amx and _ON_AMX(device, dtype)


def int4_layer(n: int, k: int, path: tuple[bool, bool]) -> Int4Linear:
    take_kiln(path)
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


def decode_ms(artifact: str, path: tuple[bool, bool], streams: int) -> Callable[[], float]:
    from kiln.runtime.engine.core import Engine
    from kiln.runtime.engine.sampling import SamplingParams

    take_kiln(path)
    engine = Engine.load(artifact)
    words = ("the", "river", "stone", "garden", "window", "north", "candle", "field", "letter")
    # ~126 tokens each, a different order per stream
    prompts = [" ".join(words[(i + j) % len(words)] for j in range(126)) for i in range(streams)]

    def tokens(count: int) -> float:
        params = SamplingParams(max_tokens=count, temperature=0.0, ignore_eos=True)
        began = time.process_time()
        engine.generate(prompts, params)
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
    parser.add_argument("--streams", default="1,32", help="streams decoded at once (--artifact)")
    args = parser.parse_args()
    if not native.avx2_kernels_available():
        raise SystemExit("kiln's int4 kernel needs an x86 CPU with AVX2 and FMA and a compiler")
    torch.set_num_threads(1)
    paths = {**PATHS, **(AMX_PATH if native.amx_kernels_available() else {})}
    names, last = list(paths), list(paths)[-1]
    print(f"machine: {machine()}; 1 thread; CPU ms (best of {args.rounds} alternating rounds)")
    ratios = [f"{n} / {last}" for n in names[:-1]]
    print(f"| layer | rows | {' | '.join(names + ratios)} |")
    print(f"|---|---|{'---|' * (2 * len(names) - 1)}")
    for name, (n, k, _) in SHAPES.items():
        if name == "lm_head":  # the demo keeps its LM head in bf16
            continue
        copies = max(1, STREAM_BYTES // (n * k // 2))
        layers = {p: [int4_layer(n, k, on) for _ in range(copies)] for p, on in paths.items()}
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, k).to(torch.bfloat16)
            ms = best_of({p: layer_ms(layers[p], x, args.calls) for p in paths}, args.rounds)
            cells = [f"{ms[p]:.3f}" for p in names]
            cells += [f"{ms[p] / ms[last]:.2f}x" for p in names[:-1]]
            print(f"| {name} {n}x{k} | {rows} | {' | '.join(cells)} |")
    for streams in (int(s) for s in args.streams.split(",")) if args.artifact else ():
        print(f"\n{streams} greedy stream(s) of {args.artifact}, CPU ms per decode step:")
        runs = {p: decode_ms(args.artifact, on, streams) for p, on in paths.items()}
        ms = best_of(runs, args.rounds)
        for p in names:
            print(f"  {p}: {ms[p]:.1f} ms ({1000 * streams / ms[p]:.1f} tok/s)")
        for p in names[:-1]:
            print(f"  {p} / {last}: {ms[p] / ms[last]:.2f}x")


if __name__ == "__main__":
    main()
