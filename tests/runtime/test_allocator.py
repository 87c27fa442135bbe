"""The CPU engine keeps freed activation memory mapped (glibc's malloc thresholds)."""

from __future__ import annotations

import platform
import sys

import pytest

from kiln.runtime import allocator

glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc",
    reason="the thresholds are glibc's",
)


@glibc
def test_thresholds_apply_once_per_process() -> None:
    assert allocator.keep_freed_memory() is True
    assert allocator.keep_freed_memory() is True  # asking again changes nothing


@glibc
def test_the_thresholds_are_accepted_by_glibc() -> None:
    assert allocator._mallopt() is True
