"""Reading files kiln did not write: only regular files, anywhere.

A FIFO blocks whoever opens it until a writer comes (kiln would hang with no message), a
socket or device is no file at all, and a dangling link names nothing. Every reader of
user input (recipes, model sources, calibration and traffic data, artifacts) opens files
through `read_bytes` / `read_text` / `open_regular`, which open without blocking and refuse
what is not a regular file, and checks a directory a library will read (a checkpoint for
transformers or safetensors) with `irregular_entries` first. Symbolic links to regular
files are followed where a tree may hold them (a Hugging Face hub snapshot is made of them);
an artifact holds none (`links=False`).
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

from kiln.runtime.base.errors import UsageError

ErrorType = Callable[[str], Exception]  # an error class taking the message

KINDS = {
    stat.S_IFIFO: "a FIFO",
    stat.S_IFSOCK: "a socket",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFDIR: "a directory",
}


def what_is(mode: int) -> str:
    """The kind of file `mode` (from stat) describes, as a problem line says it."""
    return KINDS.get(stat.S_IFMT(mode), "not a regular file")


def regular_problem(path: Path) -> str | None:
    """Why `path` is not a regular file one can read (None: it is), following links."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            return f"a dangling link (to {os.readlink(path)})"
        return "file not found"
    except OSError as exc:
        return f"cannot be read ({exc.strerror})"
    return None if stat.S_ISREG(mode) else f"{what_is(mode)}, not a regular file"


@contextlib.contextmanager
def open_regular(
    path: str | Path, error: ErrorType = UsageError, what: str = ""
) -> Iterator[IO[bytes]]:
    """`path` opened for reading in binary, never blocking on a FIFO; `error` (naming `what`
    and the path) when it is not a regular file."""
    path = Path(path)
    label = f"{what} {path}" if what else str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise error(f"{label}: {regular_problem(path)}") from None
    except OSError as exc:
        raise error(f"{label}: cannot be read ({exc.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise error(f"{label}: {what_is(mode)}, not a regular file; kiln reads regular files only")
    os.set_blocking(fd, True)
    with os.fdopen(fd, "rb") as handle:
        yield handle


def read_bytes(path: str | Path, error: ErrorType = UsageError, what: str = "") -> bytes:
    """The contents of the regular file `path` (see `open_regular`)."""
    with open_regular(path, error, what) as handle:
        return handle.read()


def read_text(path: str | Path, error: ErrorType = UsageError, what: str = "") -> str:
    """The UTF-8 text of the regular file `path` (see `open_regular`)."""
    data = read_bytes(path, error, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        label = f"{what} {path}" if what else str(path)
        raise error(f"{label}: not UTF-8 text (byte {exc.start}); give a text file") from None


def irregular_entries(root: Path, *, links: bool = True) -> list[str]:
    """One line per entry under `root` that a reader must not open: anything but a regular
    file or a directory (a FIFO, a socket, a device), a dangling link, and with
    `links=False` any symbolic link at all. Directories are walked without following links."""
    problems: list[str] = []
    for directory, dirs, names in os.walk(root, followlinks=False):
        for name in [*dirs, *names]:
            path = Path(directory, name)
            rel = path.relative_to(root).as_posix()
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                if not links:
                    problems.append(f"{rel}: a symbolic link (to {os.readlink(path)})")
                elif (why := regular_problem(path)) is not None and not path.is_dir():
                    problems.append(f"{rel}: {why}")
            elif not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
                problems.append(f"{rel}: {what_is(st.st_mode)}, not a regular file")
    return sorted(problems)
