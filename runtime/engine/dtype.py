"""The compute dtype `--dtype auto` resolves to, and why.

On a GPU "auto" is the checkpoint's dtype (float32 checkpoints stay float32). On a CPU it is
bfloat16 where the CPU computes bf16 natively (x86 `avx512_bf16` dot products or AMX
`amx_bf16` tiles: oneDNN's bf16 GEMMs then stream half the bytes of float32 at full rate).
On a CPU without them but with AVX2 and FMA it is bfloat16 too where kiln's native kernels
load: its bf16-weight linear kernel (runtime/engine/native/csrc/bf16_linear.cpp) widens the weights
in registers and accumulates in float32, so a decode step reads half float32's bytes (SmolLM2-135M
on a 2-core AVX2 EPYC: see docs/benchmarks.md). Elsewhere float32: torch's own bf16 matmul
there is a generic loop, slower than float32.

`KILN_DTYPE=float32|bfloat16|float16` in the environment says what "auto" means for every
engine of the process and the processes it starts (kiln serve, the gate, lm-eval's `kiln`
model), e.g. to gate and serve in float32 on a bf16 CPU; an explicit dtype still wins.

`cpu_flags` reads the flags line of /proc/cpuinfo; where there is none (not Linux) it asks
torch's own CPU probes. `native_bf16` is a pure function of that string so the decision can
be tested for any CPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from kiln.runtime.base.errors import UsageError
from kiln.runtime.engine.native.cpu import NATIVE_BF16_FLAGS, cpu_flags, native_bf16

OVERRIDE = "KILN_DTYPE"
EXPLICIT = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The compute dtype and the reason, for the startup log and /v1/models."""

    dtype: torch.dtype
    reason: str

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def choose_dtype(
    name: str,
    config: dict[str, Any],
    device: torch.device,
    flags: str | None = None,
    override: str | None = None,
    bf16_kernel: bool | None = None,
) -> DtypeChoice:
    """The compute dtype for `--dtype NAME` on `device` (`flags`: the CPU's, read when None;
    `override`: what "auto" means, $KILN_DTYPE when None; `bf16_kernel`: whether kiln's
    bf16-weight kernel serves this CPU, asked of the native kernels when None)."""
    if name != "auto":
        return DtypeChoice(getattr(torch, name), f"--dtype {name}")
    override = os.environ.get(OVERRIDE, "") if override is None else override
    if override:
        if override not in EXPLICIT:
            raise UsageError(
                f"{OVERRIDE}={override!r} is not a dtype; set it to one of {', '.join(EXPLICIT)} "
                "or unset it to let the runtime choose"
            )
        return DtypeChoice(getattr(torch, override), f"auto: {OVERRIDE}={override}")
    if device.type != "cpu":
        saved = config.get("dtype") or config.get("torch_dtype") or "bfloat16"
        return DtypeChoice(getattr(torch, saved), f"auto: the checkpoint's dtype on {device}")
    flags = cpu_flags() if flags is None else flags
    flag = native_bf16(flags)
    if flag is not None:
        return DtypeChoice(torch.bfloat16, f"auto: the CPU computes bf16 natively ({flag})")
    listed = " or ".join(NATIVE_BF16_FLAGS)
    if bf16_kernel is None:
        from kiln.runtime.engine import native

        bf16_kernel = native.avx2_kernels_available(flags)
    if bf16_kernel:
        return DtypeChoice(
            torch.bfloat16,
            f"auto: no native bf16 ({listed}), kiln's AVX2 kernel reads bf16 weights and "
            "accumulates in float32",
        )
    return DtypeChoice(
        torch.float32, f"auto: the CPU has no native bf16 ({listed}) nor AVX2 with FMA"
    )
