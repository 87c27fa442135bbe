"""Freed memory back to the system, for the stages that stream a model: each large tensor's as
soon as it is freed (calibration), or a layer's after the layer (the report, the exports).

glibc serves an allocation from its heap unless it is larger than its mmap threshold, and it
raises that threshold (up to 32 MiB) each time a large block is freed, so a process that
allocates and frees one layer's tensors after another ends up with the freed layers kept in its
heap, fragmented, and counted in its RSS: a 16-layer model's report peaked 350 MB above a
2-layer one's of the same shape. A fixed 1 MiB threshold gives every tensor of that size its own
mapping, returned whole when freed (measured: the two peaks within 40 MB). Small allocations,
where the heap is faster, are unchanged. Hand-written: no library exposes glibc's mallopt.

That threshold costs a page fault for every 4 KiB of every tensor, each time one is made: the
1.17B report took ~1.4 million faults, a third of its CPU time in the kernel. Where a model is
streamed a layer at a time and the layers' tensors repeat in size (the report, its float half,
the exports), `reuse_within_layers` lets the heap keep tensors up to 32 MiB for reuse, and
`trim_freed` after each layer hands what the heap holds free back to the system: the same
report took ~0.3 million faults and ~25% less time, peaking 150 MB higher (a layer's tensors).
The streamed models (the report and its float half) trim only once the process has grown by
two layers' parameters beyond what one layer holds (`GrowthTrim`): each layer then reuses what
the last one freed rather than faulting it in again.

The same holds for Python's own heap of objects: `collection_paused` keeps the cycle collector
from rescanning what imports make, and `uncollected_at_exit` spares a process's shutdown a
scan of everything it made (their docstrings give the measurements).
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import os
import sys
from collections.abc import Iterator

M_MMAP_THRESHOLD = -3
M_TRIM_THRESHOLD = -1
THRESHOLD = 1 << 20
REUSED = 32 << 20  # glibc's own ceiling for the threshold it raises as large blocks are freed
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
TRIMMED_BY_CALLER = (1 << 31) - 1  # the heap's top goes back by `trim_freed`, not on each free


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library where it is found (its lookup runs ldconfig: once)."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    try:
        return None if name is None else ctypes.CDLL(name)
    except OSError:
        return None


def reuse_within_layers() -> bool:
    """Serve allocations below REUSED bytes from the heap, kept for reuse when freed until
    `trim_freed` (glibc only); whether the setting took. For a process that streams a model
    and calls `trim_freed` after each layer."""
    libc = _glibc()
    try:
        return libc is not None and bool(
            libc.mallopt(M_MMAP_THRESHOLD, REUSED)
            and libc.mallopt(M_TRIM_THRESHOLD, TRIMMED_BY_CALLER)
        )
    except AttributeError:
        return False  # not glibc (musl has no mallopt)


def trim_freed() -> None:
    """Hand the free memory of every heap back to the system (glibc's malloc_trim): what a
    finished layer's tensors held."""
    libc = _glibc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is not None:
        trim(0)


def resident_bytes() -> int | None:
    """This process's resident memory (Linux's /proc/self/statm), or None where unknown."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return None


class GrowthTrim:
    """`trim_freed` for a caller that runs one layer after another, whenever the process holds
    more than `slack` bytes above its level: what it held after the first layer, raised only to
    what it still holds right after a trim (memory in use, not free). Trimming after every layer
    hands back what the next layer allocates again, and each 4 KiB of it is faulted in afresh
    (the 1.17B report, float and quantised sides: 0.83 million faults, 4.0 s of kernel time;
    about 0.25 million held to two layers' slack); never trimming lets fragments of freed layers
    pile up (its resident memory grew 0.4 GB over 22 layers, at 2.97B 0.6 GB). Held to `slack`
    above the level, the layers reuse what the heap holds and, after each layer, the process is
    never more than `slack` above what it uses. Where resident memory cannot be read it trims
    every time."""

    def __init__(self, slack: int) -> None:
        self.slack = slack
        self.level: int | None = None

    def __call__(self, *_: object) -> None:
        now = resident_bytes()
        if now is None:
            trim_freed()
        elif self.level is None:
            self.level = now
        elif now > self.level + self.slack:
            trim_freed()
            after = resident_bytes()  # what is in use: the level rises only to that
            self.level = max(self.level, after if after is not None else self.level)


@contextlib.contextmanager
def collection_paused() -> Iterator[None]:
    """Python's cycle collector off within (on again after, where it was on): for code that
    imports libraries or builds long-lived state, making hundreds of thousands of objects that
    live on and little garbage. Each full collection the collector runs while a heap grows
    scans all of it, and it runs one each time the heap has grown by a quarter: `kiln compile`
    on a 1.17B model spent 0.65 s of a core in six of them while it hashed the source beside
    the report's imports (transformers', a tokenizer's), and the report's float half ~0.5 s
    in its own imports."""
    import gc

    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def uncollected_at_exit() -> None:
    """Leave the objects that exist when this process exits to the system rather than to
    Python's cycle collector. Python's shutdown runs full collections over every object the
    process made, and a process that imported torch, transformers and a quantiser holds
    millions: `kiln compile` on a 1.17B model spent ~1 s of one core in them after its last
    line (0.25 s with this), as did the report's float half. Registered early, the freeze runs
    after the atexit handlers registered later (the libraries'); objects still go when their
    last reference does, and the few left in cycles are reclaimed with the process, whose
    finalisers Python never promised to run at exit."""
    import atexit
    import gc

    atexit.register(gc.freeze)


def return_large_frees() -> bool:
    """Make allocations of THRESHOLD bytes or more mappings of their own (glibc only); whether
    the setting took."""
    libc = _glibc()
    try:
        return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD))
    except AttributeError:
        return False  # not glibc (musl has no mallopt)
