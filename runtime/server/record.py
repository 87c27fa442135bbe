"""`kiln serve --record`: write served requests as TrafficRecord lines (runtime/formats/traffic.py).

Privacy by default: without `--record-prompts` a line keeps the request's settings but
replaces its prompt or messages with their SHA-256 and token count (`"redacted"`), which
is enough for load shape (lengths, rates, settings) but not for replay or calibration.
Responses are stored only with `--record-responses`. A sampled fraction of requests is
recorded (`--record-sample-rate`); the decision is made per request, before it runs.
Token-id prompts are stored as their decoded text (traffic readers expect text), with the
ids themselves beside it under `prompt_token_ids`.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.runtime.base.errors import UsageError
from kiln.runtime.formats.traffic import REDACTED, TrafficRecord, append_record


@dataclass(slots=True)
class RecordSettings:
    path: Path
    sample_rate: float = 1.0
    prompts: bool = False
    responses: bool = False

    def __post_init__(self) -> None:
        if not 0.0 <= self.sample_rate <= 1.0:
            raise UsageError(f"--record-sample-rate {self.sample_rate}: must be in [0, 1]")
        self.path = Path(self.path)
        if not self.path.parent.is_dir():
            raise UsageError(f"--record {self.path}: directory {self.path.parent} does not exist")


def prompt_digest(value: Any) -> str:
    """SHA-256 of a prompt or message list in canonical JSON (equal prompts, equal hashes)."""
    canonical = json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class TrafficRecorder:
    """Appends one TrafficRecord line per sampled request."""

    def __init__(self, settings: RecordSettings, seed: int | None = None) -> None:
        self.settings = settings
        self._random = random.Random(seed)
        self.written = 0

    def sample(self) -> bool:
        """Whether to record the next request."""
        rate = self.settings.sample_rate
        return rate >= 1.0 or (rate > 0.0 and self._random.random() < rate)

    def write(
        self,
        request_id: str,
        endpoint: str,
        body: dict[str, Any],
        prompt_tokens: int,
        response: dict[str, Any] | None,
        extra: dict[str, Any],
        decoded_prompts: list[str] | None = None,
    ) -> TrafficRecord:
        """Record one finished request. `decoded_prompts` stands in for token-id prompts."""
        request = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
        key = "messages" if "messages" in request else "prompt"
        extra = dict(extra)
        if not self.settings.prompts:
            content = request.pop(key)
            request[REDACTED] = {"sha256": prompt_digest(content), "prompt_tokens": prompt_tokens}
        elif decoded_prompts is not None:
            extra["prompt_token_ids"] = request[key]
            request[key] = decoded_prompts[0] if len(decoded_prompts) == 1 else decoded_prompts
        record = TrafficRecord(
            id=request_id,
            time=time.time(),
            endpoint=endpoint,
            request=request,
            response=response if self.settings.responses else None,
            extra=extra,
        )
        append_record(self.settings.path, record)
        self.written += 1
        return record
