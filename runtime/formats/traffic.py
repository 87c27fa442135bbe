"""Recorded serving traffic: one JSON object per line, the format `kiln serve --record` writes.

A line is either a full record

    {"id": "req-1", "time": 1760000000.0, "endpoint": "/v1/chat/completions",
     "request": {"messages": [...], "max_tokens": 64, "temperature": 0.0},
     "response": {...}}                                   # response is optional

or a bare OpenAI request body (`{"prompt": ...}` or `{"messages": [...]}`), whose endpoint
is inferred and whose id is `line-N`. A server that does not store prompts (the default of
`kiln serve --record`) writes a redacted request instead: no `prompt` / `messages`, but
`"redacted": {"sha256": ..., "prompt_tokens": N}`; such lines are refused by readers that
need the text (replay, calibration) unless they pass `allow_redacted=True`.
Calibration (quant), the gate's replay (gates) and the
server (runtime) all read and write through this module; it uses the standard library only.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kiln.runtime.base.errors import UsageError
from kiln.runtime.base.jsonlines import json_objects

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"
ENDPOINTS = (COMPLETIONS, CHAT_COMPLETIONS)
REDACTED = "redacted"  # request key of a record whose prompt was not stored


class TrafficError(UsageError):
    """A traffic file that is missing or has a malformed line (exit 2)."""


@dataclass
class TrafficRecord:
    """One recorded request (and, when recorded, its response)."""

    id: str
    time: float
    endpoint: str
    request: dict[str, Any]
    response: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint {self.endpoint!r} is not one of {', '.join(ENDPOINTS)}")
        key = "messages" if self.endpoint == CHAT_COMPLETIONS else "prompt"
        if key not in self.request:
            if self.redacted:
                return
            raise ValueError(f"a {self.endpoint} request needs `{key}`")
        if self.endpoint == CHAT_COMPLETIONS and not _valid_messages(self.request["messages"]):
            raise ValueError("`messages` must be a non-empty list of {role, content} objects")
        if self.endpoint == COMPLETIONS and not _valid_prompt(self.request["prompt"]):
            raise ValueError("`prompt` must be a string or a list of strings")

    @property
    def is_chat(self) -> bool:
        return self.endpoint == CHAT_COMPLETIONS

    @property
    def redacted(self) -> bool:
        """True when the prompt was not stored (only its hash and token count)."""
        key = "messages" if self.endpoint == CHAT_COMPLETIONS else "prompt"
        return key not in self.request and isinstance(self.request.get(REDACTED), dict)

    def prompts(self) -> list[str]:
        """The completion prompt(s) of a /v1/completions request (a list may batch several)."""
        if self.redacted:
            return []
        prompt = self.request.get("prompt", "")
        return [prompt] if isinstance(prompt, str) else list(prompt)

    def response_texts(self) -> list[str]:
        """Generated text of each recorded choice (empty when no response was recorded)."""
        out: list[str] = []
        for choice in (self.response or {}).get("choices", []):
            if self.is_chat:
                out.append(str((choice.get("message") or {}).get("content") or ""))
            else:
                out.append(str(choice.get("text") or ""))
        return out

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data.update(data.pop("extra"))
        if data["response"] is None:
            del data["response"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], default_id: str = "") -> TrafficRecord:
        """Parse a full record or a bare request body; raises ValueError saying what is wrong."""
        if "request" not in data:  # a bare OpenAI request body
            endpoint = CHAT_COMPLETIONS if "messages" in data else COMPLETIONS
            return cls(id=default_id, time=0.0, endpoint=endpoint, request=dict(data))
        if not isinstance(data["request"], dict):
            raise ValueError("`request` must be an object (an OpenAI request body)")
        request = data["request"]
        endpoint = data.get("endpoint") or (
            CHAT_COMPLETIONS if "messages" in request else COMPLETIONS
        )
        response = data.get("response")
        if response is not None and not isinstance(response, dict):
            raise ValueError("`response` must be an object when present")
        known = {"id", "time", "endpoint", "request", "response"}
        try:
            when = float(data.get("time", 0.0))
        except (TypeError, ValueError):
            raise ValueError(f"`time` must be a unix timestamp, got {data.get('time')!r}") from None
        return cls(
            id=str(data.get("id") or default_id),
            time=when,
            endpoint=str(endpoint),
            request=request,
            response=response,
            extra={k: v for k, v in data.items() if k not in known},
        )


def _valid_messages(messages: Any) -> bool:
    return (
        isinstance(messages, list)
        and bool(messages)
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in messages)
    )


def _valid_prompt(prompt: Any) -> bool:
    return isinstance(prompt, str) or (
        isinstance(prompt, list) and all(isinstance(p, str) for p in prompt)
    )


def read_traffic(path: str | Path, allow_redacted: bool = False) -> list[TrafficRecord]:
    """Every record of a traffic file; a bad line raises TrafficError naming `file:line`.

    A redacted line (prompt not stored) is an error unless `allow_redacted`: replay and
    calibration need the text.
    """
    path = Path(path)
    if not path.is_file():
        raise TrafficError(f"{path}: traffic file not found")
    records: list[TrafficRecord] = []
    for number, data in json_objects(path, TrafficError):
        where = f"{path}:{number}"
        try:
            record = TrafficRecord.from_dict(data, default_id=f"line-{number}")
        except ValueError as exc:
            raise TrafficError(f"{where}: {exc}") from None
        if record.redacted and not allow_redacted:
            raise TrafficError(
                f"{where}: the prompt was not recorded (only its hash); replay and "
                "calibration need it: record with `kiln serve --record-prompts`"
            )
        records.append(record)
    return records


def append_record(path: str | Path, record: TrafficRecord) -> None:
    """Append one record as one line; O_APPEND keeps concurrent writers' lines whole."""
    append_line(path, record.to_dict())


def append_line(path: str | Path, obj: dict[str, Any]) -> None:
    """Append one JSON object as one line with a single O_APPEND write."""
    data = (json.dumps(obj, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        while data:
            data = data[os.write(fd, data) :]
    finally:
        os.close(fd)
