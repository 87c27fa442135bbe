"""Per-user JSON caches of facts about files, trusted while a file's (path, size, mtime_ns) holds.

Ours because no library keeps such a cache, and the facts are slow to recompute: a sha256 over a
500 MB checkpoint, or a GGUF's metadata (GGUFReader parses a 49k-token vocabulary in seconds).
The files live in $XDG_CACHE_HOME/kiln/ (~/.cache/kiln/ by default): one per user, shared by every
recipe and cache_dir. Losing one only costs recomputing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from kiln.compiler.leftovers import holding
from kiln.runtime.base.atomic import replace_text
from kiln.runtime.base.cache import cache_home


class FileFacts:
    """One sidecar file: {real path: {size, mtime_ns, value}}."""

    def __init__(self, filename: str) -> None:
        self.path = cache_home() / filename
        try:
            self.entries: dict[str, dict[str, Any]] = json.loads(self.path.read_text())
        except (OSError, json.JSONDecodeError):
            self.entries = {}
        self.changed = False

    def get(self, file: Path) -> Any | None:
        """The value recorded for `file`, or None when absent or the file changed since."""
        real = file.resolve()  # hub snapshots are symlinks into blobs/
        stat = real.stat()
        hit = self.entries.get(str(real))
        if hit and hit.get("size") == stat.st_size and hit.get("mtime_ns") == stat.st_mtime_ns:
            return hit.get("value")
        return None

    def put(self, file: Path, value: Any) -> None:
        real = file.resolve()
        stat = real.stat()
        self.entries[str(real)] = {
            "size": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "value": value,
        }
        self.changed = True

    def save(self) -> None:
        """Write back if anything changed, forgetting deleted files; temp file + rename."""
        if not self.changed:
            return
        # Two runs saving at once lose one's new entries, which only costs a recomputation.
        live = {k: v for k, v in self.entries.items() if os.path.exists(k)}
        try:
            with holding(self.path.parent):  # a concurrent start's sweep leaves our temp alone
                replace_text(self.path, json.dumps(live, indent=1, sort_keys=True))
        except OSError:
            pass  # a read-only cache folder only costs recomputing next time
        self.changed = False
