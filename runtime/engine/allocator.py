"""Where a CPU engine's memory lives: freed activations stay mapped, so a step does not
page-fault its way through every new tensor, and the weights a decode step streams sit in
huge pages.

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

`in_huge_pages` places the weight copies a decode step streams (kiln's few-row copies of a
dense layer, the greedy head's int8 codes, W4A16's packed codes) in memory the kernel backs
with transparent huge pages (2 MiB), where glibc's heap would give them 4 KiB pages: a
32-row step of SmolLM2-135M reads ~200 MB of weights, ~50,000 pages, a TLB miss each.
Copies go one after another into 64 MiB anonymous mappings asked for with
`madvise(MADV_HUGEPAGE)` before anything is written; a chunk is unmapped when no copy in it
is left (the copies are views of it, and the arena holds none). Measured on a 2-core Zen 4
EPYC (one thread): a gate/up projection at 32 rows read from memory 0.58 vs 0.62 ms;
SmolLM2-135M's decode step, two engines stepped in turn (medians of 80), at 32 rows 60.3 vs
63.0 ms, at one row 12.5 vs 13.9 ms. Copies under `HUGE_MIN_BYTES` (a tiny model's) stay
where they are; where madvise is refused (no THP, another OS) the chunks are plain memory.
Hand-written too: torch's CPU allocator has one switch, THP_MEM_ALLOC_ENABLE (huge pages for
every allocation of 2 MiB or more, activations included; it did not speed serving up,
docs/benchmarks.md), and none for the weight copies alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import mmap
import sys
import threading
import weakref

import torch

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


# Off: copies stay where their kernels put them (the benchmarks compare both).
HUGE_PAGES = True
HUGE_PAGE = 2 << 20
CHUNK = 64 << 20
HUGE_MIN_BYTES = 1 << 20
ALIGN = 64  # each copy starts on a cache line

_arena_lock = threading.Lock()
# The latest copy, whose memory is the chunk being filled (weakly: a chunk lives only as long
# as copies in it do), and the bytes of that chunk handed out so far.
_latest: weakref.ref[torch.Tensor] | None = None
_used = 0


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous CPU tensor moved into huge-page-backed memory (a copy that views an arena
    chunk), or `t` itself where it is small, not on the CPU or not contiguous."""
    global _latest, _used
    if not HUGE_PAGES or t.device.type != "cpu" or not t.is_contiguous():
        return t
    if t.nbytes < HUGE_MIN_BYTES:  # a tiny model's: not worth a chunk's huge pages
        return t
    size = -(-t.nbytes // ALIGN) * ALIGN
    with _arena_lock:
        latest = _latest() if _latest is not None else None
        if latest is not None and _used + size <= latest.untyped_storage().nbytes():
            chunk = torch.empty(0, dtype=torch.uint8).set_(latest.untyped_storage())
        else:
            chunk, _used = _new_chunk(max(CHUNK, size))
        copy = chunk[_used : _used + t.nbytes].view(t.dtype).view(t.shape)
        _used += size
        _latest = weakref.ref(copy)
    copy.copy_(t)
    return copy


def _new_chunk(size: int) -> tuple[torch.Tensor, int]:
    """A fresh anonymous mapping of at least `size` bytes from a huge-page boundary, asked to
    be backed by huge pages before anything touches it, as bytes, and the offset of that
    boundary in it. Its own mapping, not malloc's: glibc serves even a large block from a
    free heap chunk when it has one, whose pages are already 4 KiB ones."""
    size = -(-size // HUGE_PAGE) * HUGE_PAGE
    if not hasattr(mmap, "MAP_PRIVATE"):  # not a Unix: plain memory
        raw = torch.empty(size + HUGE_PAGE, dtype=torch.uint8)
        return raw, -raw.data_ptr() % HUGE_PAGE
    # private: a shared anonymous mapping is shmem, whose huge pages are another setting
    flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0)
    area = mmap.mmap(-1, size + HUGE_PAGE, flags=flags)  # unmapped with the last tensor on it
    raw = torch.frombuffer(area, dtype=torch.uint8)
    offset = -raw.data_ptr() % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if advice is not None:
        with contextlib.suppress(OSError):
            area.madvise(advice, offset, size)
    return raw, offset
