"""Freed memory back to the system as soon as it is freed, for the stages that stream a model.

glibc serves an allocation from its heap unless it is larger than its mmap threshold, and it
raises that threshold (up to 32 MiB) each time a large block is freed, so a process that
allocates and frees one layer's tensors after another ends up with the freed layers kept in its
heap, fragmented, and counted in its RSS: a 16-layer model's report peaked 350 MB above a
2-layer one's of the same shape. A fixed 1 MiB threshold gives every tensor of that size its own
mapping, returned whole when freed (measured: the two peaks within 40 MB). Small allocations,
where the heap is faster, are unchanged. Hand-written: no library exposes glibc's mallopt.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

M_MMAP_THRESHOLD = -3
THRESHOLD = 1 << 20


def return_large_frees() -> bool:
    """Make allocations of THRESHOLD bytes or more mappings of their own (glibc only); whether
    the setting took."""
    if not sys.platform.startswith("linux"):
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        return bool(ctypes.CDLL(name).mallopt(M_MMAP_THRESHOLD, THRESHOLD))
    except (OSError, AttributeError):
        return False  # not glibc (musl has no mallopt)
