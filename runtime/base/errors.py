"""The KilnError family: every expected mistake a user can make maps to one of these.

It lives in `runtime` because every package may import `runtime` and `runtime` imports
nothing of ours; compiler, quant and gates raise these too.

A message names the input (file, key or path), the problem, and the fix. The CLI prints
the message without a traceback and exits with the class's exit code. `disk_full` tells a
full disk from other failures, whichever library's exception (or kiln's) carries it.
"""

from __future__ import annotations

import errno
import os
import re
import resource
import sqlite3
from collections.abc import Iterator


class KilnError(Exception):
    """Base class: an expected failure with a message meant for the user."""

    exit_code = 3

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class UsageError(KilnError):
    """Bad command-line use or bad input: a recipe, a path, an option (exit 2)."""

    exit_code = 2


class SourceError(UsageError):
    """A model source that cannot be resolved or is not supported (exit 2)."""


class CalibrationDataError(UsageError):
    """Calibration data that is missing, empty or malformed (exit 2)."""


class PreflightError(UsageError):
    """A recipe that is valid YAML but cannot work on this model or machine (exit 2)."""


class VerdictFailure(KilnError):
    """A gate verdict that blocks promotion (exit 1)."""

    exit_code = 1


class StageFailure(KilnError):
    """A stage that failed while running: a library error, out of memory (exit 3)."""

    exit_code = 3


class ArtifactError(KilnError):
    """An artifact that is missing, malformed, or whose digests do not verify (exit 3)."""

    exit_code = 3


_FULL = (errno.ENOSPC, errno.EDQUOT)
# How libraries that wrap an OSError quote it: its strerror (safetensors adds Rust's
# "(os error 28)"), or SQLite's own words for SQLITE_FULL.
_FULL_WORDS = re.compile(
    "|".join(
        [re.escape(os.strerror(n)) for n in _FULL]
        + [rf"\(os error {n}\)" for n in _FULL]
        + [r"database or disk is full"]
    ),
    re.IGNORECASE,
)
# torch's zip writer (torch.save) on a short write: it names neither the errno nor the file.
_TORCH_SHORT_WRITE = re.compile(
    r"PytorchStreamWriter failed writing|inline_container\S* \. unexpected pos"
)
_FIX = ("free some space or point the output (or the cache, $XDG_CACHE_HOME) at a larger disk, "
        "then rerun: what finished is kept")  # fmt: skip


def _chain(exc: BaseException) -> Iterator[BaseException]:
    """`exc`, then what caused it, as a traceback shows them (`raise ... from None` ends it)."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        yield link
        link = link.__cause__ or (None if link.__suppress_context__ else link.__context__)


def disk_full(exc: BaseException) -> str | None:
    """The message for a failure that a full disk (or quota) caused, however a library wrapped
    it: an OSError with ENOSPC/EDQUOT anywhere in the chain, safetensors' or SQLite's words for
    it, or torch's writer failing part-way (which gives no reason); None for anything else.
    A file past `ulimit -f` is EFBIG ("File too large"): not a full disk, and not matched."""
    chain = list(_chain(exc))
    for link in chain:
        if isinstance(link, OSError) and link.errno in _FULL:
            where = f" writing {link.filename}" if link.filename else ""
            return f"no space left on the device{where}; {_FIX}"
    # A library's exception, not kiln's: a KilnError quoting such words says what it means.
    wrapped = [link for link in chain if not isinstance(link, (OSError, KilnError))]
    for link in wrapped:
        sqlite_full = (getattr(link, "sqlite_errorcode", None) or 0) & 0xFF == sqlite3.SQLITE_FULL
        if sqlite_full or _FULL_WORDS.search(str(link)):
            return f"no space left on the device ({type(link).__name__}: {link}); {_FIX}"
    if any(isinstance(link, OSError) for link in chain):
        return None  # the chain says why a write failed, and it is not a full disk
    for link in wrapped:
        if _TORCH_SHORT_WRITE.search(str(link)):
            limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
            why = "the disk is full (see `df` on the output and $XDG_CACHE_HOME)"
            if limit != resource.RLIM_INFINITY:  # past it a write fails with EFBIG instead
                why += f", or a file reached this process's size limit ({limit} bytes, ulimit -f)"
            return (
                f"a file write stopped part-way ({type(link).__name__}: {link}); torch's writer "
                f"does not say why: most likely {why}; {_FIX}"
            )
    return None
