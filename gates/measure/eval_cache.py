"""Cached evaluations of a gate's baseline (and its noise-floor control).

The baseline of a gate rarely changes between runs while candidates do, and evaluating it
is a quarter to a half of a gate. An evaluation is stored as one JSON file named by the
sha256 of everything that shapes it: the baseline's content digest, the task files' digest,
the item limit and few-shot count, the divergence texts and settings, the scored window,
the tool versions, and which side it is (the baseline, or its control: the baseline served
by the runtime in a named compute dtype).
Change any of them and the key changes; a file that cannot be read is recomputed. The
baseline's replayed shadow answers are stored here too (gates/measure/replay_cache.py).

The files live in $KILN_GATE_CACHE, else $XDG_CACHE_HOME/kiln/gate/ (~/.cache/kiln/gate/):
one per user, shared by every gate. Deleting it only costs re-evaluating. Hand-written: a
dict to JSON, keyed by a hash.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kiln.gates.measure.tasks import TaskResult
from kiln.runtime.base.atomic import replace_text

CACHE_FORMAT = 1


def cache_root() -> Path:
    """Where cached evaluations live (read per call so tests can move it)."""
    explicit = os.environ.get("KILN_GATE_CACHE")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(base).expanduser() / "kiln" / "gate"


def files_digest(paths: Iterable[Path]) -> str:
    """sha256 over the names and bytes of files (the task definitions and their data)."""
    h = hashlib.sha256()
    for path in sorted(paths, key=str):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def evaluation_key(parts: Mapping[str, Any]) -> str:
    """The cache key of an evaluation: sha256 of its canonical JSON description."""
    text = json.dumps({"format": CACHE_FORMAT, **parts}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def encode(
    results: Mapping[str, TaskResult],
    topk: list[list[dict[int, float]]] | None,
    token_ids: list[list[int]] | None,
) -> dict[str, Any]:
    """An evaluation as JSON-ready data (JSON object keys are strings)."""
    return {
        "results": {name: asdict(r) for name, r in results.items()},
        "topk": topk,
        "token_ids": token_ids,
    }


def decode(
    data: Mapping[str, Any],
) -> tuple[dict[str, TaskResult], list[list[dict[int, float]]] | None, list[list[int]] | None]:
    """The inverse of `encode`: integer item ids and token ids restored."""
    results = {}
    for name, r in data["results"].items():
        r = dict(r)
        r["per_item"] = {int(k): float(v) for k, v in r["per_item"].items()}
        results[name] = TaskResult(**r)
    topk = data.get("topk")
    if topk is not None:
        topk = [[{int(t): float(lp) for t, lp in pos.items()} for pos in text] for text in topk]
    return results, topk, data.get("token_ids")


class EvaluationCache:
    """JSON files of evaluations under one folder, keyed by `evaluation_key`."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or cache_root()

    def get(self, key: str) -> dict[str, Any] | None:
        path = self.root / f"{key}.json"
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    def put(self, key: str, data: Mapping[str, Any]) -> Path:
        """Write atomically (a killed gate never leaves half a file)."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"{key}.json"
        replace_text(path, json.dumps(data))
        return path
