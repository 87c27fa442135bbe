"""Building a torch C++ extension so that a killed build never blocks the next one.

torch's `cpp_extension.load` builds in `<extensions root>/<name>/` behind a lock *file*
(`FileBaton`): a process killed mid-build leaves the file, and every later load waits on it
forever, silently. kiln builds instead under an `fcntl.flock` on `<root>/<name>.lock`,
which the kernel releases when its holder dies, into a private directory it renames into
place once the shared object is complete; a finished build is loaded directly. A wait for a
live builder is bounded and says, at intervals, which lock and process it waits on.
No library does this (torch's own loader is the one that hangs), so it is ours.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

log = logging.getLogger(__name__)

WAIT_S = 900.0  # for another process's build; KILN_NATIVE_BUILD_WAIT_S overrides
REPORT_EVERY_S = 30.0


class BuildLockTimeout(RuntimeError):
    """Another process held the build lock longer than the wait allows."""


def extensions_root() -> Path:
    """Where torch keeps built extensions: $TORCH_EXTENSIONS_DIR, else torch's default root
    with its `py<version>_<accelerator>` folder."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given:
        return Path(given)
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    folder = f"py{sys.version_info.major}{sys.version_info.minor}{sys.abiflags}_{accelerator}"
    return Path(get_default_build_root()) / folder


def library_path(name: str, root: Path | None = None) -> Path:
    """The shared object a finished build of extension `name` leaves."""
    return (root or extensions_root()) / name / f"{name}.so"


@contextlib.contextmanager
def build_lock(path: Path, wait_s: float | None = None) -> Iterator[None]:
    """Hold an exclusive flock on `path` (the kernel drops it if this process dies); wait at
    most `wait_s` (default $KILN_NATIVE_BUILD_WAIT_S, else WAIT_S) for a holder, saying
    whom every REPORT_EVERY_S, then BuildLockTimeout."""
    if wait_s is None:
        wait_s = float(os.environ.get("KILN_NATIVE_BUILD_WAIT_S", WAIT_S))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        began = last = time.monotonic()
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                holder = _holder(path)
                if now - began >= wait_s:
                    raise BuildLockTimeout(
                        f"{path}: another build of kiln's native kernels ({holder}) held this "
                        f"lock for {now - began:.0f} s; let it finish, stop that process, or set "
                        "KILN_NATIVE=0 to run without the native kernels"
                    ) from None
                if now - last >= REPORT_EVERY_S:
                    log.warning("kiln runtime: waiting %.0f s for %s, held by %s (a build of "
                                "the native kernels)", now - began, path, holder)  # fmt: skip
                    last = now
                time.sleep(0.2)
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        try:
            yield
        finally:
            handle.seek(0)
            handle.truncate()
            fcntl.flock(handle, fcntl.LOCK_UN)


def _holder(path: Path) -> str:
    try:
        pid = path.read_text().strip()
    except OSError:
        pid = ""
    return f"process {pid}" if pid else "a process"


def build_and_load(
    name: str,
    compile_into: Callable[[Path], None],
    root: Path | None = None,
    wait_s: float | None = None,
) -> Path:
    """Load extension `name`, building it first where no finished build exists:
    `compile_into(dir)` compiles and loads it with its shared object in `dir`. Returns the
    shared object's path."""
    root = root or extensions_root()
    final = root / name
    done = library_path(name, root)
    if done.is_file():
        torch.ops.load_library(str(done))
        return done
    with build_lock(root / f"{name}.lock", wait_s):
        if done.is_file():  # another process finished it while this one waited
            torch.ops.load_library(str(done))
            return done
        private = root / f"{name}.build-{os.getpid()}"
        shutil.rmtree(private, ignore_errors=True)
        private.mkdir(parents=True)
        try:
            compile_into(private)
            if final.exists():  # what a build killed before this scheme left (no .so)
                shutil.rmtree(final)
            os.replace(private, final)
        finally:
            shutil.rmtree(private, ignore_errors=True)
    return done
