"""The runtime's bf16 dense layers on SmolLM2-135M's shapes: oneDNN-packed, plain F.linear and
kiln's bf16 kernel.

    PYTHONPATH=. python tests/benchmarks/runtime_linear.py --rows 1,32,128

One thread, CPU time (time.process_time: on a shared host it moves far less than wall time).
For each projection shape (q/k/v stacked, o, gate/up stacked, down, the tied LM head) and row
count: F.linear in float32 (float32 input, the weight widened: what `--dtype float32` runs,
and the bar kiln's bf16 kernel meets on CPUs without native bf16); where oneDNN computes bf16
(AVX512-BF16, AMX), the weight reordered once into oneDNN's blocked layout for 32 rows (what
`DenseLinear` runs there from 2 rows, or past 128 rows with AMX) and for a 1-row batch;
F.linear on the plain weight (oneDNN re-blocks it on every call); and, where kiln's native
kernels load, kiln's bf16 kernel on its panels (runtime/engine/native/csrc/bf16_linear.cpp: the
runtime's choice on AVX2 CPUs without native bf16; on CPUs with it, the column says whether it would
beat oneDNN there); where the CPU has AVX512-BF16, kiln's kernel on its pairs of k
(dpbf16_linear.cpp: the runtime's choice for every row count there without AMX); and where the CPU
has AMX, kiln's AMX kernel (amx_linear.cpp). Layers cycle through enough copies of their weight (256
MB: more than a server CPU's last-level cache) that one call never finds the previous call's weight
in the caches, as in a decode step that streams every layer. Also printed: the single-thread read
bandwidth (a float32 sum of 256 MB) and the fixed cost of one `DenseLinear` call (a 16 x 32 weight),
which bound what a single-token step can reach. Ratios compare columns of one run; the figures only
compare within one run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kiln.runtime.engine import native
from kiln.runtime.engine.layers.dense import DenseLinear
from kiln.runtime.engine.layers.linear import onednn_runs_bf16
from kiln.runtime.formats.weights import LinearWeights, WeightScheme
from tests.benchmarks.cpu_comparison import machine

SHAPES = {  # name: (out_features, in_features, calls per decode step)
    "qkv": (960, 576, 30),
    "o_proj": (576, 576, 30),
    "gate_up": (3072, 576, 30),
    "down": (576, 1536, 30),
    "lm_head": (49152, 576, 1),
}
STREAM_BYTES = 256 * 2**20


FLOAT32 = "float32 F.linear"  # reads twice the bytes of the bf16 variants


def cpu_ms(fn: Callable[[], object], calls: int, repeats: int = 5) -> float:
    """Best-of-`repeats` CPU milliseconds per call."""
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(repeats):
        began = time.process_time()
        for _ in range(calls):
            fn()
        best = min(best, (time.process_time() - began) / calls)
    return best * 1000


def cycling(
    layers: list[Callable[[torch.Tensor], torch.Tensor]], x: torch.Tensor
) -> Callable[[], object]:
    index = [0]

    def call() -> object:
        index[0] = (index[0] + 1) % len(layers)
        return layers[index[0]](x)

    return call


def packed_call(packed: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def plain_call(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: F.linear(x, weight)


def kiln_call(panels: torch.Tensor, n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: torch.ops.kiln.bf16_linear(x, panels, n, None)


def dpbf16_call(pairs: torch.Tensor, n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: torch.ops.kiln.dpbf16_linear(x, pairs, n, None)


def amx_call(tiles: torch.Tensor, n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: torch.ops.kiln.amx_linear(x, tiles, n, None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,32,128", help="row counts (tokens per call)")
    parser.add_argument("--calls", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"machine: {machine()}; 1 thread; CPU ms per call (best of 5 x {args.calls})")
    big = torch.ones(STREAM_BYTES // 4, dtype=torch.float32)
    read = big.nbytes / cpu_ms(big.sum, 3) / 1e6
    del big
    cpu = torch.device("cpu")
    tiny = DenseLinear(LinearWeights(WeightScheme(), torch.randn(16, 32)), torch.bfloat16, cpu)
    one = torch.randn(1, 32, dtype=torch.bfloat16)
    fixed_us = cpu_ms(lambda: tiny(one), 2000) * 1000
    print(f"read bandwidth {read:.1f} GB/s; fixed cost of a DenseLinear call {fixed_us:.1f} us")
    rows = [int(r) for r in args.rows.split(",")]
    step: dict[tuple[str, int], float] = {}
    for name, (n, k, per_step) in SHAPES.items():
        weight = torch.randn(n, k, dtype=torch.bfloat16) * 0.02
        copies = [weight.clone() for _ in range(max(1, STREAM_BYTES // weight.nbytes))]
        variants: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {}
        if onednn_runs_bf16():  # oneDNN refuses to pack bf16 elsewhere
            variants["oneDNN packed"] = [
                packed_call(torch.ops.mkldnn._reorder_linear_weight(w, 32)) for w in copies
            ]
            variants["packed for 1 row"] = [
                packed_call(torch.ops.mkldnn._reorder_linear_weight(w, 1)) for w in copies
            ]
        variants["plain F.linear"] = [plain_call(w) for w in copies]
        # float32 on the widened weight: what --dtype float32 runs (twice the bytes)
        variants[FLOAT32] = [plain_call(w.float()) for w in copies[: len(copies) // 2]]
        if native.avx2_kernels_available():
            variants["kiln kernel"] = [kiln_call(torch.ops.kiln.bf16_pack(w), n) for w in copies]
        if native.dpbf16_kernels_available():
            variants["kiln AVX512-BF16"] = [
                dpbf16_call(torch.ops.kiln.dpbf16_pack(w), n) for w in copies
            ]
        if native.amx_kernels_available():
            variants["kiln AMX"] = [amx_call(torch.ops.kiln.amx_pack(w), n) for w in copies]
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16)
            inputs = {FLOAT32: x.float()}
            times = {
                v: cpu_ms(cycling(layers, inputs.get(v, x)), args.calls)
                for v, layers in variants.items()
            }
            for v, ms in times.items():
                step[(v, m)] = step.get((v, m), 0.0) + ms * per_step
            read = {v: weight.nbytes * (2 if v == FLOAT32 else 1) for v in times}
            cells = "  ".join(
                f"{v} {ms:.3f} ms ({read[v] / ms / 1e6:.1f} GB/s)" for v, ms in times.items()
            )
            print(f"{name:8s} {n}x{k} rows={m:4d}: {cells}", flush=True)
    print("\nall projections of one step (30 layers + LM head):")
    for m in rows:
        base = next(ms for (_, r), ms in step.items() if r == m)
        cells = ", ".join(
            f"{v} {ms:.1f} ms ({ms / base:.2f}x)" for (v, r), ms in step.items() if r == m
        )
        print(f"  rows={m}: {cells}")


if __name__ == "__main__":
    main()
