"""Replay: send recorded requests to baseline and candidate alike for the shadow comparison.

Service meshes mirror traffic but discard the mirror's answers, so the gate captures both
sides itself: every recorded request (`runtime.traffic`) is sent to both sides with the
same settings (greedy by default), and each pair of answers goes to the shadow comparison
(gates/measure/shadow.py). `kiln serve --mirror` is the live counterpart: its mirror log holds
pairs answered to live traffic.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Protocol

from kiln.gates.measure.shadow import ShadowReport, compare_pair, summarize_pairs
from kiln.runtime.formats.side_answer import SideAnswer
from kiln.runtime.formats.traffic import TrafficRecord


class Side(Protocol):
    """Something that answers OpenAI-style requests: an endpoint, an engine, a model."""

    name: str

    def complete(self, record: TrafficRecord) -> SideAnswer:
        """Answer one request (a single prompt or one chat) exactly as it is written."""
        ...


@dataclass(slots=True)
class ReplaySettings:
    """What replay forces on every request so both sides decode identically."""

    temperature: float | None = 0.0  # None keeps each request's own sampling settings
    max_tokens: int | None = None  # None keeps each request's own max_tokens
    # For requests that name no limit: servers' defaults differ (16 for completions, the
    # context for chats), so replay sets one explicitly and both sides stop alike.
    default_max_tokens: int = 64
    max_requests: int | None = None
    concurrency: int = 1
    worst: int = 5


def replay_requests(
    records: Sequence[TrafficRecord], settings: ReplaySettings
) -> list[TrafficRecord]:
    """One request per prompt with the forced settings (a batched prompt list is split)."""
    out: list[TrafficRecord] = []
    for record in records:
        prompts: list[str | None] = [None] if record.is_chat else list(record.prompts())
        for i, prompt in enumerate(prompts):
            request = copy.deepcopy(record.request)
            request.pop("stream", None)
            request["n"] = 1
            if prompt is not None:
                request["prompt"] = prompt
            if settings.temperature is not None:
                request["temperature"] = settings.temperature
                if settings.temperature == 0:
                    request.pop("top_p", None)
                    request.pop("top_k", None)
            if settings.max_tokens is not None:
                request["max_tokens"] = settings.max_tokens
            elif "max_tokens" not in request and "max_completion_tokens" not in request:
                request["max_tokens"] = settings.default_max_tokens
            rid = record.id if len(prompts) == 1 else f"{record.id}#{i}"
            out.append(TrafficRecord(rid, record.time, record.endpoint, request))
    return out[: settings.max_requests] if settings.max_requests else out


def replay(
    records: Sequence[TrafficRecord],
    baseline: Side,
    candidate: Side,
    settings: ReplaySettings | None = None,
    progress: Callable[[str], None] | None = None,
) -> ShadowReport:
    """Send every request to both sides with identical settings and compare the answers."""
    settings = settings or ReplaySettings()
    requests = replay_requests(records, settings)

    def one(record: TrafficRecord) -> tuple[SideAnswer, SideAnswer]:
        # Sequential per request: the two sides never compete for the same machine.
        return baseline.complete(record), candidate.complete(record)

    with ThreadPoolExecutor(max_workers=max(1, settings.concurrency)) as pool:
        answers = []
        for i, pair in enumerate(pool.map(one, requests), start=1):
            answers.append(pair)
            if progress:
                progress(f"replay: {i}/{len(requests)} requests")
    pairs = [compare_pair(r, b, c) for r, (b, c) in zip(requests, answers, strict=True)]
    base, cand = [a[0] for a in answers], [a[1] for a in answers]
    return summarize_pairs(pairs, base, cand, asdict(settings), settings.worst)
