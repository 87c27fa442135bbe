"""W8A8 int8 layers on a CPU: `torch._int_mm` vs kiln's bf16-panel path, float32 beside them.

    PYTHONPATH=. python tests/benchmarks/int8_cpu.py --rows 1,32,512 [--artifact W8A8_DIR]

One thread, CPU time (time.process_time). For each of SmolLM2-135M's projection shapes
(the LM head aside: W8A8 keeps it dense) and row count: `Int8Linear` on `_int_mm` (int32
accumulation; the path on CPUs with VNNI), `Int8Linear` on bf16 panels (the codes
multiplied by kiln's bf16-weight kernel; the path on x86 CPUs without VNNI) and a float32
`DenseLinear` of the same shape. With `--artifact` (a W8A8 artifact: `kiln compile` of a
SmoothQuant recipe) it also scores `--texts` random 512-token texts through the runtime's
lm-eval model on each path, as a gate does. The CPU and its flags head the output; ratios
compare columns of one run.
"""

from __future__ import annotations

import argparse
import random
import time
from collections.abc import Callable
from functools import partial

import torch

from kiln.runtime.engine.layers import int8
from kiln.runtime.engine.layers.dense import DenseLinear
from kiln.runtime.engine.layers.int8 import Int8Linear
from kiln.runtime.engine.layers.kernels import make_linear
from kiln.runtime.formats.weights import ActivationScheme, LinearWeights, WeightScheme
from tests.benchmarks.cpu_comparison import machine
from tests.benchmarks.runtime_linear import SHAPES, cpu_ms

PATHS = {"_int_mm": True, "bf16 panels": False}  # name: whether `_int_mm` is taken


def take_int_mm(int_mm: bool) -> None:
    """Layers built from here on take `_int_mm` (True) or the bf16 panels (False)."""
    int8.int8_gemm_native = lambda flags=None: int_mm


def int8_layer(n: int, k: int, int_mm: bool) -> Int8Linear:
    take_int_mm(int_mm)
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    scheme = WeightScheme("int", 8, "channel", activations=ActivationScheme())
    layer = make_linear(
        [LinearWeights(scheme, codes, torch.rand(n, 1) * 0.01)], torch.float32, torch.device("cpu")
    )
    assert isinstance(layer, Int8Linear)
    return layer


def score(artifact: str, int_mm: bool, count: int) -> float:
    """CPU seconds to score `count` x 512 random tokens (top-20 log-probabilities)."""
    from kiln.gates.measure.lm_eval_adapter import KilnLM

    take_int_mm(int_mm)
    lm = KilnLM(artifact=artifact)
    rng = random.Random(0)
    texts = [[rng.randrange(100, 40000) for _ in range(512)] for _ in range(count)]
    began = time.process_time()
    lm.topk_logprobs(texts, 20)
    return time.process_time() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,32,512", help="row counts (tokens per call)")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--artifact", help="a W8A8 artifact to score end to end")
    parser.add_argument("--texts", type=int, default=2, help="512-token texts to score")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {machine()}; 1 thread; CPU ms per call (best of 5 x {args.calls})")
    for name, (n, k, _) in SHAPES.items():
        if name == "lm_head":  # W8A8 keeps the LM head dense
            continue
        layers: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            path: int8_layer(n, k, int_mm) for path, int_mm in PATHS.items()
        }
        layers["float32 dense"] = DenseLinear(
            LinearWeights(WeightScheme(), torch.randn(n, k)), torch.float32, torch.device("cpu")
        )
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k)
            times = {path: cpu_ms(partial(f, x), args.calls) for path, f in layers.items()}
            panels = times["bf16 panels"]
            cells = "  ".join(f"{p} {ms:.3f} ms ({ms / panels:.2f}x)" for p, ms in times.items())
            print(f"{name:8s} {n}x{k} rows={m:4d}: {cells}", flush=True)
    if args.artifact:
        seconds = {path: score(args.artifact, int_mm, args.texts) for path, int_mm in PATHS.items()}
        cells = ", ".join(f"{p} {s:.1f} s" for p, s in seconds.items())
        ratio = seconds["_int_mm"] / seconds["bf16 panels"]
        print(f"\nscoring {args.texts} x 512 tokens (top-20), CPU s: {cells} ({ratio:.1f}x)")


if __name__ == "__main__":
    main()
