"""Writing a small file kiln owns all at once: readers see the old content or the new,
never half, and a failed write (a full disk, a kill between write and rename) leaves no
temporary behind. One writer's temporary never collides with another's (its pid and a
random token name it). Ours: the standard library's tempfile leaves its file on failure.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path


def replace_text(path: Path, text: str, *, fsync: bool = False) -> None:
    """Write `text` to `path` through a temporary beside it and one rename; with `fsync`,
    the content reaches the disk before the rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        with os.fdopen(os.open(tmp, flags, 0o644), "w") as handle:
            handle.write(text)
            if fsync:
                handle.flush()
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
