"""Native CPU kernels of the runtime, compiled from runtime/csrc/ on first use.

Hand-written where no installable library does the job on a CPU box (see each source's
header): today one, single-token attention read straight from the paged KV cache. The
build uses torch's extension builder (a C++ compiler and ninja; ninja is a dependency),
once per machine and source version; the shared object is cached in torch's extensions
directory (TORCH_EXTENSIONS_DIR). Where the build is impossible (no compiler) the runtime
logs why once and keeps its pure-torch path; KILN_NATIVE=0 turns the kernels off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / "paged_attention.cpp"]
OPS = ("paged_decode_attention",)
# -march=native: the build is for the machine that runs it, so the cache key includes
# the CPU's feature flags (a shared home directory on another CPU rebuilds).
CFLAGS = ["-O3", "-march=native", "-fopenmp"]

_lock = threading.Lock()
_loaded: bool | None = None


def available() -> bool:
    """Whether the native kernels are loaded (building them on first call)."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _load() -> bool:
    if os.environ.get("KILN_NATIVE", "1") == "0":
        return False
    try:
        from torch.utils.cpp_extension import load

        log.info("kiln runtime: loading native CPU kernels (built once per machine, ~20 s)")
        load(
            name=f"kiln_native_{_build_key()}",
            sources=[str(path) for path in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
        return all(hasattr(torch.ops.kiln, op) for op in OPS)
    except Exception as error:  # no compiler, no ninja, a failed build: keep the torch path
        log.warning(
            "kiln runtime: native CPU kernels unavailable (%s); decode attention uses the "
            "pure-torch path (slower). Install a C++ compiler, or set KILN_NATIVE=0 to silence.",
            str(error).splitlines()[0] if str(error) else type(error).__name__,
        )
        return False


def _build_key() -> str:
    digest = hashlib.sha256()
    for path in SOURCES:
        digest.update(path.read_bytes())
    digest.update(" ".join(CFLAGS).encode())
    digest.update(torch.__version__.encode())
    try:
        flags = next(
            line
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("flags")
        )
        digest.update(flags.encode())
    except (OSError, StopIteration):
        pass
    return digest.hexdigest()[:12]
