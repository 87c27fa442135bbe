"""Stages as pure functions of their inputs, cached by a hash of those inputs.

A stage writes into a fresh hidden directory; only when its function returns is the
directory renamed to `<cache>/<stage>/<key>/` with a `stage.json` beside the outputs
(`{stage, key, seconds, output}`: the function's record, and the cache's bookkeeping apart). So an
unchanged re-run finds every stage done, and a run killed mid-way resumes at the first
stage whose directory is missing. Partial directories of a killed run are swept at start
under the output directory's lock (compiler/leftovers.py). Neither the lock nor the cache is
reached through a symbolic link: a link planted in a shared output directory must not turn
kiln's writes onto another file.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import stat
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.runtime.base.errors import KilnError, StageFailure, UsageError

CACHE_DIR = ".kiln-cache"  # under an output directory
LOCK_FILE = ".kiln.lock"
STAGE_RECORD = "stage.json"
PARTIAL = ".partial"


def input_key(*parts: Any) -> str:
    """sha256 of the canonical JSON of the inputs: the stage's cache key."""
    blob = json.dumps(parts, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()


@dataclass
class StageResult:
    """What a stage produced: where, whether it ran now, how long it took, and its output
    record (what the stage function returned; the cache's own bookkeeping is kept apart)."""

    name: str
    key: str
    path: Path
    status: str  # "ran" | "cached"
    seconds: float
    record: dict[str, Any]


class StageCache:
    """The `.kiln-cache` directory under an output root."""

    def __init__(self, root: Path) -> None:
        if root.is_symlink():
            raise UsageError(
                f"{root}: is a symbolic link (to {os.readlink(root)}); kiln keeps its stage "
                "cache in a real directory: remove the link, or set a different output directory"
            )
        self.root = root

    def stage_dir(self, name: str, key: str) -> Path:
        return self.root / name / key[:24]

    def lookup(self, name: str, key: str) -> StageResult | None:
        path = self.stage_dir(name, key)
        record_path = path / STAGE_RECORD
        if not record_path.is_file():
            return None
        stored = json.loads(record_path.read_text())
        if stored.get("key") != key or not isinstance(stored.get("output"), dict):
            return None  # another layout, or a prefix collision: run the stage again
        return StageResult(name, key, path, "cached", float(stored["seconds"]), stored["output"])

    def run(
        self,
        name: str,
        key: str,
        fn: Callable[[Path], dict[str, Any] | None],
        force: bool = False,
    ) -> StageResult:
        """Return the cached result for (name, key), or run `fn(out_dir)` and publish it."""
        if not force and (hit := self.lookup(name, key)) is not None:
            return hit
        final = self.stage_dir(name, key)
        final.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=f".{key[:12]}-", suffix=PARTIAL, dir=final.parent))
        start = time.perf_counter()
        try:
            record = fn(work) or {}
        except KilnError:
            shutil.rmtree(work, ignore_errors=True)
            raise
        except MemoryError as exc:
            shutil.rmtree(work, ignore_errors=True)
            raise StageFailure(
                f"stage {name} ran out of memory; lower calibration.num_samples or "
                "calibration.max_seq_len"
            ) from exc
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        seconds = time.perf_counter() - start
        stored = {"stage": name, "key": key, "seconds": round(seconds, 3), "output": record}
        (work / STAGE_RECORD).write_text(json.dumps(stored, indent=2, sort_keys=True, default=str))
        if final.exists():
            shutil.rmtree(final)
        os.replace(work, final)
        return StageResult(name, key, final, "ran", seconds, record)


KERNEL_FILESYSTEMS = (Path("/proc"), Path("/sys"), Path("/dev"))


def output_problem(root: Path) -> str | None:
    """Why `root` cannot be an output directory (None when it can): a file, a kernel
    filesystem, or a place this user cannot write."""
    root = Path(os.path.abspath(root))
    for kernel in KERNEL_FILESYSTEMS:
        if root.is_relative_to(kernel):
            return f"{root} is under {kernel}, a kernel filesystem, not storage"
    existing = root
    while not os.path.lexists(existing):
        existing = existing.parent
    if not existing.is_dir():
        what = "is a file" if existing == root else f"cannot be created: {existing} is a file"
        return f"{root} {what}; an output directory holds artifacts and the stage cache"
    if not os.access(existing, os.W_OK | os.X_OK) or os.statvfs(existing).f_flag & os.ST_RDONLY:
        return f"{root} cannot be written here ({existing} is read-only for this user)"
    return None


@contextmanager
def output_lock(root: Path) -> Iterator[None]:
    """Hold an exclusive lock on an output root so two compiles never interleave there."""
    if (problem := output_problem(root)) is not None:
        raise UsageError(f"output: {problem}; set `output:` or --output to a writable directory")
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"output: cannot create {root} ({exc.strerror})") from None
    lock_path = root / LOCK_FILE
    try:
        # Never truncated, never through a link: the lock is only ever flocked.
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as exc:
        problem = "is a symbolic link" if lock_path.is_symlink() else exc.strerror
        raise UsageError(
            f"{lock_path}: {problem}; kiln locks its output directory with a plain file there: "
            "remove it, or set a different output directory"
        ) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UsageError(
                f"{lock_path}: is not a plain file; remove it, or set a different output directory"
            )
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UsageError(
                f"{root}: another `kiln compile` is writing here; wait for it or set a "
                "different output directory"
            ) from None
        yield
    finally:
        os.close(fd)  # closing releases the lock
