"""A killed build of the native kernels never blocks a later one (runtime/engine/native/
extension.py): a stale lock file of torch's loader is ignored, a lock whose holder died is
free, and a live holder is waited on for a bounded time with a message naming the lock."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kiln.runtime.engine import native
from kiln.runtime.engine.native.extension import (
    BuildLockTimeout,
    build_and_load,
    build_lock,
    library_path,
)

CC = shutil.which("cc") or shutil.which("gcc")
needs_cc = pytest.mark.skipif(CC is None, reason="no C compiler")
HOLD = """
import sys, time
from pathlib import Path
from kiln.runtime.engine.native.extension import build_lock
with build_lock(Path(sys.argv[1])):
    print("held", flush=True)
    time.sleep(600)
"""


def compile_c(directory: Path, name: str) -> None:
    """A real build, if a small one: a C shared object named as torch names extensions."""
    source = directory / f"{name}.c"
    source.write_text("int kiln_lock_test(void) { return 1; }\n")
    subprocess.run([str(CC), "-shared", "-fPIC", "-o", str(directory / f"{name}.so"),
                    str(source)], check=True)  # fmt: skip


def hold_lock(path: Path) -> subprocess.Popen[str]:
    """A process that takes the build lock and keeps it."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


@needs_cc
def test_a_stale_lock_file_of_torchs_loader_does_not_block_the_build(tmp_path: Path) -> None:
    name = "kiln_lock_stale"
    (tmp_path / name).mkdir()
    (tmp_path / name / "lock").write_text("")  # what a build killed inside torch's load leaves
    began = time.monotonic()
    built = build_and_load(name, lambda d: compile_c(d, name), root=tmp_path)
    assert built == library_path(name, tmp_path) and built.is_file()
    assert not (tmp_path / name / "lock").exists()  # the killed build's directory is replaced
    assert time.monotonic() - began < 30


@needs_cc
def test_a_build_killed_while_holding_the_lock_frees_it(tmp_path: Path) -> None:
    name = "kiln_lock_killed"
    holder = hold_lock(tmp_path / f"{name}.lock")
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=10)
    built = build_and_load(name, lambda d: compile_c(d, name), root=tmp_path, wait_s=10)
    assert built.is_file()


@needs_cc
def test_a_finished_build_is_loaded_without_building_again(tmp_path: Path) -> None:
    name = "kiln_lock_done"
    build_and_load(name, lambda d: compile_c(d, name), root=tmp_path)

    def refuse(_directory: Path) -> None:
        raise AssertionError("built again")

    assert build_and_load(name, refuse, root=tmp_path).is_file()


def test_a_live_builder_is_waited_on_for_a_bounded_time_naming_the_lock(tmp_path: Path) -> None:
    lock = tmp_path / "kiln_lock_live.lock"
    holder = hold_lock(lock)
    try:
        began = time.monotonic()
        with pytest.raises(BuildLockTimeout) as refused, build_lock(lock, wait_s=1.0):
            pass
        assert time.monotonic() - began < 10
        assert str(lock) in str(refused.value) and f"process {holder.pid}" in str(refused.value)
    finally:
        holder.kill()
        holder.wait(timeout=10)


def test_the_native_kernels_refuse_with_the_lock_named_instead_of_hanging(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("KILN_NATIVE_BUILD_WAIT_S", "1")
    name = "kiln_native_locked"
    holder = hold_lock(tmp_path / f"{name}.lock")
    try:
        with pytest.raises(native.NativeBuildError, match=f"{name}.lock"):
            native.build(native.SOURCES, name)
    finally:
        holder.kill()
        holder.wait(timeout=10)
