"""Shadow traffic: replay recorded requests against baseline and candidate and compare.

Service meshes mirror traffic but discard the mirror's answers, so the gate captures both
sides itself: every recorded request (`runtime.traffic`) is sent to both sides with the
same settings (greedy by default), and the pair of answers is compared.

Metrics: exact-match rate; matching-prefix length (characters, and tokens where both sides
return token ids); first-divergence position; length ratio; format-error rate (invalid JSON
where the request asked for JSON: `response_format` json_object/json_schema, or the word
"JSON" in the prompt); transport error rate; TTFT and TPOT p50/p99 per side. The worst
pairs (shortest shared prefix relative to the answer length) are kept for the report.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import numpy as np

from kiln.gates.rules import Check, GatePolicy, threshold_check
from kiln.runtime.traffic import TrafficRecord


@dataclass(slots=True)
class SideResponse:
    """One side's answer to one request; `error` set means it failed to answer."""

    text: str = ""
    token_ids: list[int] | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    error: str | None = None
    finish_reason: str | None = None


class Side(Protocol):
    """Something that answers OpenAI-style requests: an endpoint, an engine, a model."""

    name: str

    def complete(self, record: TrafficRecord) -> SideResponse:
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


@dataclass(slots=True)
class PairDiff:
    """One request answered by both sides, and how their answers differ."""

    id: str
    prompt: str
    baseline: str
    candidate: str
    exact: bool
    prefix_chars: int
    prefix_tokens: int | None
    first_divergence: int | None  # char index of the first difference; None when equal
    wants_json: bool
    baseline_json_ok: bool | None
    candidate_json_ok: bool | None
    baseline_error: str | None = None
    candidate_error: str | None = None

    @property
    def agreement(self) -> float:
        """Shared prefix as a share of the longer answer (1.0 when both are equal)."""
        longest = max(len(self.baseline), len(self.candidate))
        return 1.0 if longest == 0 else self.prefix_chars / longest


@dataclass(slots=True)
class LatencyStats:
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None


@dataclass(slots=True)
class ShadowReport:
    """Shadow replay summary: the metrics, the per-side latency, the worst pairs."""

    num_requests: int
    exact_match_rate: float
    mean_prefix_chars: float
    mean_prefix_tokens: float | None
    median_first_divergence: float | None
    length_ratio: float
    num_json_requests: int
    baseline_format_error_rate: float
    candidate_format_error_rate: float
    baseline_error_rate: float
    candidate_error_rate: float
    baseline_latency: LatencyStats
    candidate_latency: LatencyStats
    settings: dict[str, Any] = field(default_factory=dict)
    worst: list[PairDiff] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["worst"] = [{**asdict(p), "agreement": p.agreement} for p in self.worst]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShadowReport:
        data = dict(data)
        data["baseline_latency"] = LatencyStats(**data["baseline_latency"])
        data["candidate_latency"] = LatencyStats(**data["candidate_latency"])
        worst = []
        for item in data.get("worst", []):
            item = {k: v for k, v in item.items() if k != "agreement"}
            worst.append(PairDiff(**item))
        data["worst"] = worst
        return cls(**data)


# --- requests -------------------------------------------------------------------------

_JSON_WORD = re.compile(r"\bJSON\b")
_FENCE = re.compile(r"^```(?:json)?\s*\n?(.*?)\n?```$", re.DOTALL)


def request_text(record: TrafficRecord) -> str:
    """The prompt text of a request: the prompt, or every chat message's content."""
    if record.is_chat:
        return "\n".join(str(m.get("content") or "") for m in record.request["messages"])
    return "\n".join(record.prompts())


def wants_json(record: TrafficRecord) -> bool:
    """True when the request asked for JSON: response_format, or the prompt says JSON."""
    fmt = record.request.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
        return True
    return bool(_JSON_WORD.search(request_text(record)))


def is_valid_json(text: str) -> bool:
    """Whether text parses as JSON; one surrounding ``` fence is allowed (models add it)."""
    body = text.strip()
    fenced = _FENCE.match(body)
    if fenced:
        body = fenced.group(1).strip()
    try:
        json.loads(body)
    except ValueError:
        return False
    return True


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


# --- comparison -----------------------------------------------------------------------


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the shared prefix of two sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def compare_pair(record: TrafficRecord, base: SideResponse, cand: SideResponse) -> PairDiff:
    """Compare one request's two answers."""
    prefix = common_prefix(base.text, cand.text)
    exact = base.error is None and cand.error is None and base.text == cand.text
    tokens = None
    if base.token_ids is not None and cand.token_ids is not None:
        tokens = common_prefix(base.token_ids, cand.token_ids)
    json_wanted = wants_json(record)
    return PairDiff(
        id=record.id,
        prompt=request_text(record),
        baseline=base.text,
        candidate=cand.text,
        exact=exact,
        prefix_chars=prefix,
        prefix_tokens=tokens,
        first_divergence=None if base.text == cand.text else prefix,
        wants_json=json_wanted,
        baseline_json_ok=is_valid_json(base.text) if json_wanted and not base.error else None,
        candidate_json_ok=is_valid_json(cand.text) if json_wanted and not cand.error else None,
        baseline_error=base.error,
        candidate_error=cand.error,
    )


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def _latency(responses: list[SideResponse]) -> LatencyStats:
    ttft = [r.ttft_s for r in responses if r.ttft_s is not None and r.error is None]
    tpot = [r.tpot_s for r in responses if r.tpot_s is not None and r.error is None]
    return LatencyStats(_pct(ttft, 50), _pct(ttft, 99), _pct(tpot, 50), _pct(tpot, 99))


def summarize_pairs(
    pairs: list[PairDiff],
    base: list[SideResponse],
    cand: list[SideResponse],
    settings: ReplaySettings,
) -> ShadowReport:
    """Aggregate per-request comparisons into the shadow report."""
    n = len(pairs)
    if n == 0:
        raise ValueError("shadow replay had no requests to compare")
    token_prefixes = [p.prefix_tokens for p in pairs if p.prefix_tokens is not None]
    divergences = [p.first_divergence for p in pairs if p.first_divergence is not None]
    json_pairs = [p for p in pairs if p.wants_json]
    base_chars = sum(len(p.baseline) for p in pairs)
    cand_chars = sum(len(p.candidate) for p in pairs)

    def format_errors(key: str) -> float:
        judged = [getattr(p, key) for p in json_pairs]
        return sum(1 for ok in judged if ok is False) / len(judged) if judged else 0.0

    worst = sorted((p for p in pairs if not p.exact), key=lambda p: (p.agreement, p.id))
    return ShadowReport(
        num_requests=n,
        exact_match_rate=sum(p.exact for p in pairs) / n,
        mean_prefix_chars=sum(p.prefix_chars for p in pairs) / n,
        mean_prefix_tokens=sum(token_prefixes) / len(token_prefixes) if token_prefixes else None,
        median_first_divergence=float(np.median(divergences)) if divergences else None,
        length_ratio=cand_chars / base_chars if base_chars else (1.0 if not cand_chars else 0.0),
        num_json_requests=len(json_pairs),
        baseline_format_error_rate=format_errors("baseline_json_ok"),
        candidate_format_error_rate=format_errors("candidate_json_ok"),
        baseline_error_rate=sum(r.error is not None for r in base) / n,
        candidate_error_rate=sum(r.error is not None for r in cand) / n,
        baseline_latency=_latency(base),
        candidate_latency=_latency(cand),
        settings=asdict(settings),
        worst=worst[: settings.worst],
    )


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

    def one(record: TrafficRecord) -> tuple[SideResponse, SideResponse]:
        # Sequential per request: the two sides never compete for the same machine.
        return baseline.complete(record), candidate.complete(record)

    with ThreadPoolExecutor(max_workers=max(1, settings.concurrency)) as pool:
        answers = []
        for i, pair in enumerate(pool.map(one, requests), start=1):
            answers.append(pair)
            if progress:
                progress(f"shadow: {i}/{len(requests)} requests")
    pairs = [compare_pair(r, b, c) for r, (b, c) in zip(requests, answers, strict=True)]
    return summarize_pairs(pairs, [a[0] for a in answers], [a[1] for a in answers], settings)


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def shadow_checks(report: ShadowReport, policy: GatePolicy) -> list[Check]:
    """The shadow thresholds of a policy applied to a replay report."""
    deviation = abs(report.length_ratio - 1.0)
    format_increase = report.candidate_format_error_rate - report.baseline_format_error_rate
    base_lat, cand_lat = report.baseline_latency, report.candidate_latency
    return [
        threshold_check(
            "shadow: exact match", report.exact_match_rate, ">=", policy.shadow_exact_match_min
        ),
        threshold_check(
            "shadow: format errors (candidate - baseline)",
            format_increase,
            "<=",
            policy.shadow_format_error_increase_max,
        ),
        threshold_check(
            "shadow: candidate error rate",
            report.candidate_error_rate,
            "<=",
            policy.shadow_error_rate_max,
        ),
        threshold_check(
            "shadow: |length ratio - 1|", deviation, "<=", policy.shadow_length_ratio_deviation_max
        ),
        threshold_check(
            "shadow: TTFT p50 ratio",
            _ratio(cand_lat.ttft_p50, base_lat.ttft_p50),
            "<=",
            policy.shadow_ttft_p50_ratio_max,
        ),
        threshold_check(
            "shadow: TPOT p50 ratio",
            _ratio(cand_lat.tpot_p50, base_lat.tpot_p50),
            "<=",
            policy.shadow_tpot_p50_ratio_max,
        ),
    ]
