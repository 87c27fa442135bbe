"""`kiln bench`'s report: latency distributions (TTFT, TPOT, ITL, end to end), throughput,
and goodput under SLO limits, computed as `vllm bench serve` defines them."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kiln.runtime.base.errors import UsageError
from kiln.runtime.client.http import (
    StreamResult,
)

PERCENTILES = (50, 90, 99)


SLO_KEYS = ("ttft_ms", "tpot_ms", "e2el_ms")


@dataclass(slots=True)
class SLO:
    """Service-level objectives in milliseconds; None leaves that metric unconstrained."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2el_ms: float | None = None

    def met_by(self, result: StreamResult) -> bool:
        """Whether a request succeeded within every limit (a one-token answer has no TPOT)."""
        if not result.ok or result.ttft_s is None or result.latency_s is None:
            return False
        checks = (
            (self.ttft_ms, result.ttft_s),
            (self.tpot_ms, result.tpot_s),
            (self.e2el_ms, result.latency_s),
        )
        return all(lim is None or val is None or val * 1000 <= lim for lim, val in checks)

    @property
    def empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2el_ms is None


def parse_slo(text: str) -> SLO:
    """`ttft_ms=500,tpot_ms=50,e2el_ms=8000` (any subset) → SLO; UsageError on a bad item."""
    slo = SLO()
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise UsageError(
                f"--slo {item!r}: expected KEY=MILLISECONDS with KEY one of {', '.join(SLO_KEYS)}"
            )
        try:
            limit = float(value)
        except ValueError:
            raise UsageError(f"--slo {item!r}: {value!r} is not a number of ms") from None
        if not limit > 0:
            raise UsageError(f"--slo {item!r}: the limit must be > 0 ms")
        setattr(slo, key, limit)
    return slo


@dataclass(slots=True)
class Distribution:
    """Mean and percentiles of one metric, in milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of_seconds(cls, values: list[float]) -> Distribution | None:
        if not values:
            return None
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        p50, p90, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
        return cls(float(ms.mean()), p50, p90, p99)


@dataclass(slots=True)
class BenchReport:
    """What one benchmark run measured."""

    url: str
    model: str | None
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    concurrency: int | None
    request_rate: float | None  # None: all at once
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (input + output) tokens / s
    ttft_ms: Distribution | None
    tpot_ms: Distribution | None
    itl_ms: Distribution | None
    e2el_ms: Distribution | None
    slo: SLO = field(default_factory=SLO)
    good_requests: int | None = None
    goodput: float | None = None  # requests / s meeting every SLO
    short_outputs: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # message → count
    requests: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(
    results: list[StreamResult],
    duration_s: float,
    *,
    slo: SLO | None = None,
    expected_output: list[int | None] | None = None,
    input_tokens: list[int | None] | None = None,
    url: str = "",
    model: str | None = None,
    concurrency: int | None = None,
    request_rate: float | None = None,
) -> BenchReport:
    """Turn per-request stream results into the report; failed requests count only as errors.

    `expected_output[i]` is the fixed length request i asked for (None: free length);
    `input_tokens[i]` is its known prompt length, used where the server reports no usage.
    """
    slo = slo or SLO()
    count = len(results)
    expected = expected_output or [None] * count
    known_inputs = input_tokens or [None] * count
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if r.error is not None:
            errors[r.error] = errors.get(r.error, 0) + 1
    total_in = sum(
        (r.prompt_tokens if r.prompt_tokens is not None else (n or 0))
        for r, n in zip(results, known_inputs, strict=True)
        if r.ok
    )
    total_out = sum(r.output_tokens for r in ok)
    duration = max(duration_s, 1e-9)
    good = sum(slo.met_by(r) for r in results) if not slo.empty else None
    short = sum(
        1
        for r, want in zip(results, expected, strict=True)
        if r.ok and want is not None and r.output_tokens < want
    )
    per_request = [
        {
            "ttft_s": r.ttft_s,
            "tpot_s": r.tpot_s,
            "latency_s": r.latency_s,
            "output_tokens": r.output_tokens if r.ok else 0,
            "prompt_tokens": r.prompt_tokens,
            "finish_reason": r.finish_reason,
            "error": r.error,
        }
        for r in results
    ]
    return BenchReport(
        url=url,
        model=model,
        num_requests=count,
        completed=len(ok),
        failed=count - len(ok),
        duration_s=duration_s,
        concurrency=concurrency,
        request_rate=request_rate,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=len(ok) / duration,
        output_throughput=total_out / duration,
        total_token_throughput=(total_in + total_out) / duration,
        ttft_ms=Distribution.of_seconds([r.ttft_s for r in ok if r.ttft_s is not None]),
        tpot_ms=Distribution.of_seconds([r.tpot_s for r in ok if r.tpot_s is not None]),
        itl_ms=Distribution.of_seconds([gap for r in ok for gap in r.itl_s]),
        e2el_ms=Distribution.of_seconds([r.latency_s for r in ok if r.latency_s is not None]),
        slo=slo,
        good_requests=good,
        goodput=good / duration if good is not None else None,
        short_outputs=short,
        errors=errors,
        requests=per_request,
    )


def write_json(report: BenchReport, path: str | Path) -> None:
    """Write the report as one JSON object."""
    Path(path).write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
