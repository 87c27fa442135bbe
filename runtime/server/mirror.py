"""The mirror: send a fraction of served requests to a candidate engine and log both answers.

The candidate is a separate Engine stepped by its own thread, fed through a bounded queue:
`offer` never blocks and drops the request when the queue is full, so a slow candidate
costs the primary nothing but the enqueue. A request is mirrored after the primary has
answered it (both answers are then at hand for one log line); the candidate gets the same
request (a chat rendered by its own chat template), with the same sampling settings and seed.
The candidate's latencies are its own, measured alone on its thread (`answer_alone`); the
primary's are the server's, measured under the live load.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.runtime.base.errors import UsageError
from kiln.runtime.engine.answer import answer_alone
from kiln.runtime.engine.sampling import SamplingParams
from kiln.runtime.formats.mirror_log import MirrorEntry, append_entry
from kiln.runtime.formats.side_answer import SideAnswer

log = logging.getLogger("kiln.serve.mirror")


@dataclass(slots=True)
class MirrorJob:
    """A primary's finished request, waiting for the candidate's answer."""

    entry: MirrorEntry
    prompt: str | list[int] | None  # completion prompt (text or ids); None for a chat
    messages: list[dict[str, str]] | None
    params: SamplingParams


class Mirror:
    """Owns the candidate engine, its thread and its bounded queue."""

    def __init__(
        self,
        engine: Any,
        log_path: str | Path,
        fraction: float,
        model: str,
        digest: str = "",
        max_queue: int = 16,
        seed: int | None = None,
        on_done: Callable[[MirrorEntry], None] | None = None,
    ) -> None:
        if not 0.0 < fraction <= 1.0:
            raise UsageError(f"--mirror-fraction {fraction}: must be in (0, 1]")
        self.engine = engine
        self.log_path = Path(log_path)
        self.fraction = fraction
        self.model = model
        self.digest = digest
        self._queue: queue.Queue[MirrorJob | None] = queue.Queue(maxsize=max_queue)
        self._random = random.Random(seed)
        self._on_done = on_done
        self.offered = self.dropped = self.completed = 0
        self._thread = threading.Thread(target=self._loop, name="kiln-mirror", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def sample(self) -> bool:
        """Whether to mirror the next request."""
        return self.fraction >= 1.0 or self._random.random() < self.fraction

    def offer(self, job: MirrorJob) -> bool:
        """Queue a job for the candidate; False (dropped) when the queue is full."""
        self.offered += 1
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.dropped += 1
            return False
        return True

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop after the job in progress; jobs still queued are dropped."""
        while True:
            try:
                if self._queue.get_nowait() is not None:
                    self.dropped += 1
            except queue.Empty:
                break
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                # A chat is rendered here, on the only thread that uses the candidate's tokenizer.
                answer = answer_alone(self.engine, job.params, job.prompt, job.messages)
            except Exception as exc:  # a failing candidate is logged, never raised
                answer = SideAnswer(error=repr(exc))
            answer.model, answer.digest = self.model, self.digest
            job.entry.candidate = answer
            try:
                append_entry(self.log_path, job.entry)
            except OSError as exc:
                log.warning("mirror log %s: %s", self.log_path, exc)
            self.completed += 1
            if self._on_done is not None:
                self._on_done(job.entry)
