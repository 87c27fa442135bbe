"""kiln's fused elementwise CPU kernels (runtime/engine/native/csrc/elementwise.cpp) against torch's
operators.

    PYTHONPATH=. python tests/benchmarks/elementwise_cpu.py [--rows 1,32,256] [--rounds 3]

SmolLM2-135M's shapes (hidden 576, intermediate 1,536, 9 + 3 heads of 64), float32 and
bfloat16, one thread, CPU time (time.process_time), best of the rounds: RMSNorm, residual add +
RMSNorm, silu(gate) * up and the argmax of 49,152 logits, each with the torch operators the
runtime runs without kiln's kernels; RoPE in place alone (torch's form rotates copies). Set
KILN_NATIVE_MARCH=x86-64-v3 to time the build a CPU with AVX2 but no AVX-512 gets (with
ATEN_CPU_CAPABILITY=avx2 for torch's side of it). The CPU and its flags head the output;
ratios compare columns of one run.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kiln.runtime.engine import native
from tests.benchmarks.cpu_comparison import machine

HIDDEN, INTERMEDIATE, HEADS, DIM, VOCAB = 576, 1536, 12, 64, 49152


def best_ms(run: Callable[[], object], rounds: int, calls: int = 20) -> float:
    best = float("inf")
    for _ in range(rounds):
        began = time.process_time()
        for _ in range(calls):
            run()
        best = min(best, (time.process_time() - began) / calls * 1000)
    return best


def torch_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    wide = x.float()
    return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype) * w


def cases(rows: int, dtype: torch.dtype) -> dict[str, tuple[Callable[[], object], ...]]:
    """{op: (kiln's kernel, torch's operators)} or (kiln's kernel,) where torch has no twin."""
    x = torch.randn(rows, HIDDEN).to(dtype)
    w = torch.rand(HIDDEN).to(dtype)
    delta = torch.randn(rows, HIDDEN).to(dtype)
    residual = x.clone()
    gate_up = torch.randn(rows, 2 * INTERMEDIATE).to(dtype)
    qkv = torch.randn(rows, HEADS * DIM * 2).to(dtype)
    positions = torch.arange(rows)
    cos, sin = torch.randn(2048, DIM).to(dtype), torch.randn(2048, DIM).to(dtype)
    logits = torch.randn(min(rows, 32), VOCAB).to(dtype)

    def torch_add_norm() -> object:
        residual.add_(delta)
        return torch_norm(residual, w)

    return {
        "rms_norm": (
            lambda: torch.ops.kiln.rms_norm(x, w, 1e-5),
            lambda: torch_norm(x, w),
        ),
        "add_rms_norm": (
            lambda: torch.ops.kiln.add_rms_norm_(residual, delta, w, 1e-5),
            torch_add_norm,
        ),
        "silu_mul": (
            lambda: torch.ops.kiln.silu_mul(gate_up),
            lambda: F.silu(gate_up[:, :INTERMEDIATE]) * gate_up[:, INTERMEDIATE:],
        ),
        "rope": (lambda: torch.ops.kiln.rope_(qkv, positions, cos, sin, HEADS, DIM),),
        f"argmax ({logits.shape[0]} rows)": (
            lambda: torch.ops.kiln.argmax_rows(logits),
            lambda: logits.max(dim=-1).indices,
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,32,256")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if not native.available():
        raise SystemExit("kiln's native kernels do not load here: nothing to compare")
    torch.set_num_threads(1)
    print(
        f"machine: {machine()}; kiln build -march={native.MARCH}; torch capability "
        f"{torch.backends.cpu.get_cpu_capability()}; 1 thread; CPU ms per call"
    )
    for dtype in (torch.float32, torch.bfloat16):
        for rows in (int(r) for r in args.rows.split(",")):
            for op, runs in cases(rows, dtype).items():
                kiln_ms = best_ms(runs[0], args.rounds)
                line = f"{str(dtype)[6:]:8s} rows={rows:4d} {op:18s} kiln {kiln_ms:.3f} ms"
                if len(runs) > 1:
                    torch_ms = best_ms(runs[1], args.rounds)
                    line += f", torch {torch_ms:.3f} ms ({torch_ms / kiln_ms:.2f}x)"
                print(line, flush=True)


if __name__ == "__main__":
    main()
