"""The CPU engine keeps freed activation memory mapped (glibc's malloc thresholds), and the
weight copies a decode step streams in huge pages."""

from __future__ import annotations

import gc
import platform
import sys
from pathlib import Path

import pytest
import torch

from kiln.runtime.engine import allocator

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="the thresholds are glibc's",
)


@glibc
def test_thresholds_apply_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    real = allocator._mallopt

    def counted() -> bool:
        calls.append(real())
        return calls[-1]

    monkeypatch.setattr(allocator, "_applied", None)  # as in a process that never asked
    monkeypatch.setattr(allocator, "_mallopt", counted)
    assert allocator.keep_freed_memory() is True
    assert allocator.keep_freed_memory() is True  # asking again changes nothing
    assert calls == [True]  # glibc was told once


@glibc
def test_the_thresholds_are_accepted_by_glibc() -> None:
    assert allocator._mallopt() is True


def test_a_large_copy_moves_into_the_arena_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "_latest", None)  # a fresh chunk: both copies fit in it
    t = torch.randn(1024, 1024).bfloat16()  # 2 MiB
    copy = allocator.in_huge_pages(t)
    assert torch.equal(copy, t) and copy.dtype == t.dtype and copy.is_contiguous()
    assert copy.data_ptr() != t.data_ptr() and copy.data_ptr() % allocator.ALIGN == 0
    following = allocator.in_huge_pages(torch.ones(allocator.HUGE_MIN_BYTES, dtype=torch.uint8))
    # the next copy goes right after it in the same chunk, on a cache line
    assert following.data_ptr() == copy.data_ptr() + t.nbytes
    assert torch.equal(copy, t) and bool((following == 1).all())


def test_small_foreign_or_strided_tensors_stay_where_they_are() -> None:
    small = torch.randn(16, 16)
    assert allocator.in_huge_pages(small) is small
    strided = torch.randn(2048, 1024).t()
    assert allocator.in_huge_pages(strided) is strided
    big = torch.randn(1024, 1024)
    copy = allocator.in_huge_pages(big)
    assert copy is not big
    copy[0, 0] = 7.0  # the copy is its own memory
    assert big[0, 0] != 7.0


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps")
def test_a_chunk_lives_as_long_as_a_copy_in_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(allocator, "_latest", None)
    first = allocator.in_huge_pages(torch.ones(1 << 20, dtype=torch.uint8))
    second = allocator.in_huge_pages(torch.full((1 << 20,), 2, dtype=torch.uint8))
    chunk = first.untyped_storage().data_ptr()
    assert _mapped(chunk)
    assert second.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
    del second  # the latest copy gone: the next one starts a chunk of its own
    third = allocator.in_huge_pages(torch.full((1 << 20,), 3, dtype=torch.uint8))
    assert third.untyped_storage().data_ptr() != first.untyped_storage().data_ptr()
    assert bool((first == 1).all()) and bool((third == 3).all())
    del first
    gc.collect()
    assert not _mapped(chunk)  # no copy left in it: unmapped
    assert _mapped(third.untyped_storage().data_ptr())


def _mapped(address: int) -> bool:
    """Whether some mapping of this process covers `address` (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        low, high = (int(x, 16) for x in line.split()[0].split("-"))
        if low <= address < high:
            return True
    return False


def test_a_copy_larger_than_a_chunk_gets_a_chunk_of_its_own() -> None:
    t = torch.arange(allocator.CHUNK // 4 + 1024, dtype=torch.int32)
    copy = allocator.in_huge_pages(t)
    assert torch.equal(copy, t)
    assert copy.data_ptr() % allocator.HUGE_PAGE == 0  # a fresh chunk starts on a huge page


def _thp_mode() -> str | None:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    return path.read_text().split("[")[1].split("]")[0]


@pytest.mark.skipif(
    _thp_mode() not in ("always", "madvise"), reason="the kernel grants no transparent huge pages"
)
def test_the_arena_is_backed_by_huge_pages() -> None:
    t = torch.randn(3 << 20)  # 12 MiB: whole huge pages inside whatever chunk it lands in
    copy = allocator.in_huge_pages(t)
    begin, end = copy.data_ptr(), copy.data_ptr() + copy.nbytes
    huge_kb = 0
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and ":" not in head:
            low, high = (int(x, 16) for x in head.split("-"))
            mapping = (low, high)
        elif (
            line.startswith("AnonHugePages:")
            and mapping
            and mapping[0] < end
            and begin < mapping[1]
        ):
            huge_kb += int(line.split()[1])
    assert huge_kb >= 4 * 2048  # at least 4 of the ~6 huge pages the copy covers
