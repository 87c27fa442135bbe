"""The mirror log: one JSON line per mirrored request with both sides' answers.

Written by `kiln serve --mirror CANDIDATE --mirror-log FILE` and judged by
`kiln gate CANDIDATE --baseline PRIMARY --mirror-log FILE` with the shadow comparison the
gate applies to replayed traffic (gates/measure/shadow.py). A line:

    {"id": "cmpl-1", "time": 1760000000.0, "endpoint": "/v1/completions",
     "prompt": "...",                       # or "<redacted sha256:...>" without --record-prompts
     "settings": {"max_tokens": 32, "temperature": 0.0, ...},
     "primary": {"model": "...", "digest": "...", "text": "...", "token_ids": [...],
                 "ttft_s": 0.05, "tpot_s": 0.01, "finish_reason": "stop", "error": null},
     "candidate": {...same keys...}}

Standard library only: the gate reads it without the server's dependencies.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln.runtime.base.errors import UsageError
from kiln.runtime.formats.side_answer import SideAnswer
from kiln.runtime.formats.traffic import append_line


@dataclass(slots=True)
class MirrorEntry:
    """One mirrored request: what was asked, and both answers."""

    id: str
    time: float
    endpoint: str
    prompt: str
    settings: dict[str, Any]
    primary: SideAnswer
    candidate: SideAnswer = field(default_factory=SideAnswer)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MirrorEntry:
        return cls(
            id=str(data["id"]),
            time=float(data["time"]),
            endpoint=str(data["endpoint"]),
            prompt=str(data["prompt"]),
            settings=dict(data.get("settings") or {}),
            primary=SideAnswer(**data["primary"]),
            candidate=SideAnswer(**data["candidate"]),
        )


def append_entry(path: str | Path, entry: MirrorEntry) -> None:
    """Append one entry as one line (whole even with concurrent writers)."""
    append_line(path, entry.to_dict())


def read_mirror_log(path: str | Path) -> list[MirrorEntry]:
    """Every entry of a mirror log; a bad line raises UsageError naming `file:line`."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: mirror log not found (write one with kiln serve --mirror-log)")
    entries = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                entries.append(MirrorEntry.from_dict(json.loads(line)))
            except (ValueError, KeyError, TypeError) as exc:
                raise UsageError(
                    f"{path}:{number}: not a mirror-log line ({type(exc).__name__}: {exc})"
                ) from None
    if not entries:
        raise UsageError(f"{path}: the mirror log is empty; no request was mirrored yet")
    return entries
