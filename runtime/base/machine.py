"""The machine a measurement ran on, as its records name it: the CPU's model and the feature
flags that change kiln's numbers (AVX2, AVX-512, AVX512-BF16, AMX), the cores, and the GPUs
`nvidia-smi` lists. The same code measures 2x apart on two hosts of one kind, so every
figure a gate or a benchmark reports carries this.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
from pathlib import Path
from typing import Any

CPUINFO = Path("/proc/cpuinfo")
# The flags that decide which of kiln's kernels (and oneDNN's) run.
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8")


def cpu_name(cpuinfo: Path = CPUINFO) -> str:
    """The CPU's model name (/proc/cpuinfo), else what the platform module says."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cpu_flags(cpuinfo: Path) -> set[str]:
    try:
        for line in cpuinfo.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "flags":
                return set(value.split())
    except OSError:
        pass
    return set()


def gpus() -> list[str]:
    """The GPUs `nvidia-smi` lists (name, memory), or none where it is absent or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    query = ["--query-gpu=name,memory.total", "--format=csv,noheader"]
    try:
        done = subprocess.run([smi, *query], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if done.returncode:
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()]


def machine_facts(cpuinfo: Path = CPUINFO) -> dict[str, Any]:
    """The machine as a record: CPU model, cores, its flags of FLAGS, and GPUs."""
    present = _cpu_flags(cpuinfo)
    return {
        "cpu": cpu_name(cpuinfo),
        "cores": os.cpu_count(),
        "cpu_flags": [f for f in FLAGS if f in present],
        "gpus": gpus(),
    }


def describe_machine(facts: dict[str, Any]) -> str:
    """One line for a report: `2-core Intel Xeon … (avx512_bf16, amx_bf16)`, GPUs after."""
    flags = ", ".join(facts.get("cpu_flags") or []) or "no AVX2"
    text = f"{facts.get('cores')}-core {facts.get('cpu')} ({flags})"
    if facts.get("gpus"):
        text += "; GPU: " + "; ".join(facts["gpus"])
    return text
