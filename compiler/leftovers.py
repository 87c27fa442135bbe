"""Temporaries a killed run leaves behind, and the one sweep that removes them all.

Every temporary kiln writes is hidden and ends in `.partial` (a directory being assembled)
or `.tmp` (a file or directory about to be renamed into place). SIGKILL skips every
`finally:`, so they are removed at the next start instead:

- under an output directory, while its lock is held (nobody else writes there): a stage's
  work directory `.kiln-cache/<stage>/.<key>-*.partial`, an artifact being assembled
  `.<name>-*.partial`, the PyTorch path's conversion written beside the report
  `.pytorch-hf-*.partial` (compiler/compile.py), and a manifest being rewritten
  `<artifact>/.manifest.json.*.tmp`, this last only where no process holds the artifact's
  manifest lock (a gate step records its verdict after the output lock is released);
- in the per-user cache, shared by concurrent runs, only while no run holds the folder
  (`holding`: a shared flock on the folder itself, so the sweep's exclusive try fails
  while anyone is writing there): converted sources `sources/.<entry>.*.tmp` and the
  sidecar files' `.<name>.<pid>.tmp`.

The walk never follows a symbolic link (lstat, and a link is unlinked, never entered), so a
link planted under an output directory cannot turn the sweep onto another folder. Ours
because no library sweeps another process's temporaries.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from fnmatch import fnmatchcase
from pathlib import Path

from kiln.compiler.stages import CACHE_DIR
from kiln.runtime.formats.artifact import MANIFEST_TEMPORARIES

# Paths under an output directory, one pattern per component, matched without following links.
OUTPUT_TEMPORARIES = (
    (CACHE_DIR, "*", ".*.partial"),  # a stage's work directory (compiler/stages.py)
    (".*.partial",),  # an artifact being assembled, the PyTorch path's conversion beside it
)
# Per-user cache folders and the temporaries in each (compiler/sources).
USER_TEMPORARIES = (
    ("sources", ".*.tmp"),  # a source being converted (sources.materialize)
    ("", ".*.tmp"),  # a sidecar of file facts being saved (sources.sidecar)
)


def sweep_output(root: Path) -> list[Path]:
    """Remove what killed runs left under an output directory; the caller holds its lock."""
    removed: list[Path] = []
    for pattern in OUTPUT_TEMPORARIES:
        for path in _matches(root, pattern):
            _remove(path)
            removed.append(path)
    for folder in _matches(root, ("*",)):  # a manifest being rewritten (artifact.write_manifest)
        removed += sweep_unheld(folder, MANIFEST_TEMPORARIES)
    return removed


def sweep_user_cache(home: Path) -> list[Path]:
    """Remove what killed runs left in the per-user cache `home`, folder by folder, where no
    live run holds the folder (one that does may be writing those very temporaries)."""
    removed: list[Path] = []
    for folder, pattern in USER_TEMPORARIES:
        removed += sweep_unheld(home / folder, pattern)
    return removed


def sweep_unheld(folder: Path, pattern: str = ".*.tmp") -> list[Path]:
    """Remove `folder`'s temporaries matching `pattern` if no run holds the folder."""
    fd = _open_dir(folder)
    if fd is None:
        return []
    removed: list[Path] = []
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return []  # a live run is writing here; the next start sweeps
        for path in _matches(folder, (pattern,)):
            _remove(path)
            removed.append(path)
    finally:
        os.close(fd)  # closing releases the lock
    return removed


@contextmanager
def holding(folder: Path) -> Iterator[None]:
    """Hold `folder` (created if missing) while writing temporaries into it, so that a
    concurrent run's sweep leaves them alone."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = _open_dir(folder)
    if fd is None:
        raise NotADirectoryError(f"{folder}: not a directory")
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


def _open_dir(folder: Path) -> int | None:
    try:
        return os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:
        return None  # missing, not a directory, or a link: nothing of ours to sweep


def _matches(folder: Path, pattern: tuple[str, ...]) -> Iterator[Path]:
    """Entries under `folder` matching `pattern` component by component; only real
    directories are entered."""
    head, *rest = pattern
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return
    for entry in entries:
        if not fnmatchcase(entry.name, head):
            continue
        if not rest:
            yield Path(entry.path)
        elif entry.is_dir(follow_symlinks=False):
            yield from _matches(Path(entry.path), tuple(rest))


def _remove(path: Path) -> None:
    try:
        mode = path.lstat().st_mode
    except OSError:
        return
    if stat.S_ISDIR(mode):
        shutil.rmtree(path, ignore_errors=True)  # rmtree never follows links inside
    else:
        path.unlink(missing_ok=True)  # a file, or a link itself (never its target)
