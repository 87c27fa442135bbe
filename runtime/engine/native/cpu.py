"""What this CPU can do, as /proc/cpuinfo spells it (torch's probes where it is absent)."""

from __future__ import annotations

from pathlib import Path

import torch

# x86 feature flags (as /proc/cpuinfo spells them) that mean bf16 runs in hardware.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


CPUINFO = Path("/proc/cpuinfo")


def native_bf16(flags: str) -> str | None:
    """The first flag in `flags` (space-separated, as in /proc/cpuinfo) that means the CPU
    computes bf16 natively, or None."""
    present = set(flags.split())
    return next((f for f in NATIVE_BF16_FLAGS if f in present), None)


def cpu_flags(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's feature flags: /proc/cpuinfo's first `flags` line, else torch's probes."""
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                return value.strip()
    except OSError:
        pass
    probes = {
        "avx512_bf16": "_is_avx512_bf16_supported",
        "amx_bf16": "_is_amx_tile_supported",  # AMX tiles ship with AMX-BF16 on every x86 part
    }
    return " ".join(
        flag for flag, probe in probes.items() if getattr(torch.cpu, probe, lambda: False)()
    )
