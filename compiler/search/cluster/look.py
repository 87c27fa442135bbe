"""What a node of the cluster sees at the paths a search shares, and which tools it runs: the
task that search/cluster/storage.py runs on every node. It imports nothing heavy, so a cold
worker answers at once."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any

from kiln.runtime.base.versions import versions

HASHED_BYTES = 1 << 20  # files up to this size are compared by content, larger by size


def fingerprint(path: str) -> str:
    """What a node sees at `path`: nothing, a file (its bytes' digest, or its size when
    large), or a directory (the names and sizes of its files)."""
    p = Path(path)
    if p.is_file():
        size = p.stat().st_size
        if size > HASHED_BYTES:
            return f"a file of {size} bytes"
        return f"a file of {size} bytes, sha256 {hashlib.sha256(p.read_bytes()).hexdigest()[:16]}"
    if p.is_dir():
        files = sorted((f.name, f.stat().st_size) for f in p.iterdir() if f.is_file())
        digest = hashlib.sha256(repr(files).encode()).hexdigest()[:16]
        return f"a directory of {len(files)} files (listing {digest})"
    return "nothing"


def what_a_node_sees(paths: list[str], tools: list[str]) -> dict[str, Any]:
    """A Ray task: the fingerprint of each of `paths` and the versions of `tools`, here."""
    import ray

    return {
        "node": f"{os.uname().nodename} ({ray.util.get_node_ip_address()})",
        "paths": {p: fingerprint(p) for p in paths},
        "tools": versions(tools),
    }
