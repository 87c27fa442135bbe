"""kiln's per-user cache folder, for facts that are slow to recompute and cheap to lose."""

from __future__ import annotations

import os
from pathlib import Path


def cache_home() -> Path:
    """$XDG_CACHE_HOME/kiln (~/.cache/kiln by default), read per call so tests can move it."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(base).expanduser() / "kiln"
