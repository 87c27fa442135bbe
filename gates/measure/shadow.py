"""Shadow comparison: a candidate's answers against the baseline's, request by request.

The pairs come from replayed traffic (gates/measure/replay.py) or from the mirror log of
`kiln serve --mirror` (live traffic); either way each pair of answers is compared here and
the `shadow_*` thresholds of the gate policy are applied to the summary.

Metrics: exact-match rate; matching-prefix length (characters, and tokens where both sides
return token ids); first-divergence position; length ratio; format-error rate (invalid JSON
where the request asked for JSON: `response_format` json_object/json_schema, or the word
"JSON" in the prompt); transport error rate; TTFT and TPOT p50/p99 per side. The worst
pairs (shortest shared prefix relative to the answer length) are kept for the report.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kiln.runtime.formats.side_answer import SideAnswer
from kiln.runtime.formats.traffic import TrafficRecord


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
    """Shadow comparison summary: the metrics, the per-side latency, the worst pairs."""

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
    # The noise floor of exact match: how often a lossless change of the baseline (its own
    # weights computed at another precision) answers exactly like it; None when unmeasured.
    control: str | None = None
    control_exact_match_rate: float | None = None

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


# --- comparison -----------------------------------------------------------------------


def common_prefix(a: Sequence[Any], b: Sequence[Any]) -> int:
    """Length of the shared prefix of two sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def compare_pair(record: TrafficRecord, base: SideAnswer, cand: SideAnswer) -> PairDiff:
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


def _latency(responses: list[SideAnswer]) -> LatencyStats:
    ttft = [r.ttft_s for r in responses if r.ttft_s is not None and r.error is None]
    tpot = [r.tpot_s for r in responses if r.tpot_s is not None and r.error is None]
    return LatencyStats(_pct(ttft, 50), _pct(ttft, 99), _pct(tpot, 50), _pct(tpot, 99))


def summarize_pairs(
    pairs: list[PairDiff],
    base: list[SideAnswer],
    cand: list[SideAnswer],
    settings: dict[str, Any] | None = None,
    worst: int = 5,
) -> ShadowReport:
    """Aggregate per-request comparisons into the shadow report; `settings` says where the
    pairs came from, `worst` how many of the least alike are kept."""
    n = len(pairs)
    if n == 0:
        raise ValueError("the shadow comparison has no requests to compare")
    token_prefixes = [p.prefix_tokens for p in pairs if p.prefix_tokens is not None]
    divergences = [p.first_divergence for p in pairs if p.first_divergence is not None]
    json_pairs = [p for p in pairs if p.wants_json]
    base_chars = sum(len(p.baseline) for p in pairs)
    cand_chars = sum(len(p.candidate) for p in pairs)

    def format_errors(key: str) -> float:
        judged = [getattr(p, key) for p in json_pairs]
        return sum(1 for ok in judged if ok is False) / len(judged) if judged else 0.0

    least_alike = sorted((p for p in pairs if not p.exact), key=lambda p: (p.agreement, p.id))
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
        settings=dict(settings or {}),
        worst=least_alike[:worst],
    )
