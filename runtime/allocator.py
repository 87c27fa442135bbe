"""Keep the memory of freed activations mapped, so a CPU step does not page-fault its way
through every new tensor.

glibc's malloc serves large blocks (from 128 KiB, rising only as they are freed) with fresh
mmaps and gives them back on free, and returns heap memory above 128 KiB to the kernel: a
prefill step's activations (megabytes per layer) are then zero-filled page by page on
every call. Raising the mmap threshold to its ceiling and the trim threshold to
`TRIM_THRESHOLD` keeps those pages for the next step. Measured on SmolLM2-135M's gate/up
projection at 2048 rows, bf16, one thread, a Xeon with AMX: 5.1 vs 14.3 ms; a float32
multiply of [2048, 1536]: 2.5 vs 5.9 ms. The cost is that memory freed after a peak stays
with the process (it is counted in the peak RSS either way).

glibc tuning has no library; this is the two `mallopt` calls, made through ctypes, and a
no-op on other C libraries.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling on 64-bit: larger blocks are still mmapped
TRIM_THRESHOLD = 512 << 20

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Tune glibc's malloc as above, once per process; whether it applied."""
    global _applied
    if _applied is None:
        _applied = _mallopt()
    return _applied


def _mallopt() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
