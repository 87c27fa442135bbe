"""Cached replay answers of a model side: the baseline's, and its shadow control's.

Replaying recorded traffic through the baseline and through its control is most of a
gate's shadow step, and neither changes while candidates do. A model side's answers are
stored in the evaluation cache (gates/measure/eval_cache.py) under a key of everything that shapes
them: the side's content digest, which side it is, the traffic file's bytes, the replay
settings, the compute dtype, and the tool versions. A gate against the same baseline then
replays only the candidate.

An answer carries the TTFT and TPOT measured when it was computed, under that moment's
machine load. The caller decides whether that is good enough: the gate re-replays the
baseline when a timing ratio is gated, and says in its notes when the ratios it reports
compare a cached baseline with a fresh candidate.

The side is loaded only when an answer is missing, so a fully cached side costs no model
load. Hand-written: a dict of answers in front of a `Side`.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kiln.gates.measure.eval_cache import EvaluationCache, evaluation_key
from kiln.gates.measure.replay import ReplaySettings, Side
from kiln.runtime.base.versions import GATE_TOOLS, versions
from kiln.runtime.formats.side_answer import SideAnswer
from kiln.runtime.formats.traffic import TrafficRecord


def replay_key(digest: str, role: str, traffic: Path, settings: ReplaySettings, dtype: str) -> str:
    """The cache key of one side's answers to one traffic file replayed one way."""
    return evaluation_key(
        {
            "side": digest,
            "role": role,
            "traffic": hashlib.sha256(traffic.read_bytes()).hexdigest(),
            "replay": asdict(settings),
            "dtype": dtype,
            "tools": versions(GATE_TOOLS, python=True),
        }
    )


class CachedSide:
    """A replay side that answers from the cache where it can and computes the rest once,
    through a side loaded on the first miss; `save` stores what it computed."""

    def __init__(
        self,
        name: str,
        load: Callable[[], Side],
        cache: EvaluationCache | None = None,
        key: str | None = None,
        fresh: bool = False,
    ) -> None:
        self.name = name
        self._load = load
        self._side: Side | None = None
        self._cache, self._key = cache, key
        self._lock = threading.Lock()
        self.answers: dict[str, SideAnswer] = {}
        if cache is not None and key is not None and not fresh:
            self.answers = _decode(cache.get(key))
        self.cached = len(self.answers)
        self.computed = 0

    @property
    def side(self) -> Side:
        """The underlying side, loaded now if no answer needed it yet."""
        with self._lock:
            if self._side is None:
                self._side = self._load()
            return self._side

    def complete(self, record: TrafficRecord) -> SideAnswer:
        if record.id not in self.answers:
            self.answers[record.id] = self.side.complete(record)
            self.computed += 1
        return self.answers[record.id]

    def save(self) -> None:
        """Store the answers when any were computed here (a killed gate stores none)."""
        if self._cache is not None and self._key is not None and self.computed:
            answers = {rid: asdict(a) for rid, a in self.answers.items()}
            self._cache.put(self._key, {"answers": answers})


def _decode(data: Mapping[str, Any] | None) -> dict[str, SideAnswer]:
    if not data or not isinstance(data.get("answers"), dict):
        return {}
    try:
        return {rid: SideAnswer(**a) for rid, a in data["answers"].items()}
    except TypeError:  # written by another SideAnswer: computed again
        return {}
