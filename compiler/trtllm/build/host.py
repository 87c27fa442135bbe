"""The builder host: which TensorRT-LLM, TensorRT and CUDA it has, and which GPUs
(nvidia-smi, or torch where nvidia-smi is absent)."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

from kiln.runtime.base.versions import version


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """One GPU as nvidia-smi reports it."""

    name: str
    compute_capability: tuple[int, int]
    driver_version: str | None = None

    @property
    def sm(self) -> str:
        return "sm{}{}".format(*self.compute_capability)


@dataclass(frozen=True, slots=True)
class BuildEnvironment:
    """What this machine can build with: tool versions (None: absent) and its GPUs."""

    tensorrt_llm: str | None
    tensorrt: str | None
    cuda: str | None
    gpus: tuple[GpuInfo, ...] = ()


def parse_compute_capability(text: str) -> tuple[int, int]:
    major, _, minor = text.strip().removeprefix("sm").partition(".")
    if not minor and len(major) > 1:  # "sm90" / "90"
        major, minor = major[:-1], major[-1]
    return int(major), int(minor or 0)


def detect_environment() -> BuildEnvironment:
    """TensorRT-LLM, TensorRT and CUDA versions and the GPUs nvidia-smi lists."""
    gpus: list[GpuInfo] = []
    smi = shutil.which("nvidia-smi")
    if smi:
        query = [smi, "--query-gpu=compute_cap,name,driver_version", "--format=csv,noheader"]
        out = subprocess.run(query, capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) == 3:
                gpus.append(GpuInfo(parts[1], parse_compute_capability(parts[0]), parts[2]))
    cuda = None
    try:
        import torch

        cuda = torch.version.cuda
        if not gpus and torch.cuda.is_available():
            gpus = [GpuInfo(torch.cuda.get_device_name(i), torch.cuda.get_device_capability(i))
                    for i in range(torch.cuda.device_count())]  # fmt: skip
    except ImportError:
        pass
    return BuildEnvironment(version("tensorrt_llm", "tensorrt-llm"),
                            version("tensorrt", "tensorrt-cu12", "tensorrt-cu13"), cuda,
                            tuple(gpus))  # fmt: skip
