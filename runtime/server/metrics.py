"""Prometheus metrics under vLLM's names (prefix `vllm:`, label `model_name`), so dashboards
and alerts written for vLLM work unchanged.

Latency histograms are observed by the server per request; gauges and counters are read
from the engine's EngineStats at scrape time (a custom collector), so they can never drift
from the engine. Speculative-decoding counters appear when the engine reports them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.runtime.engine.outputs import EngineStats

PREFIX = "vllm:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# vLLM's buckets (vllm/v1/metrics/loggers.py), so histograms line up across servers.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
SPEC_COUNTERS = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


class _EngineCollector(Collector):
    """Gauges and counters straight from EngineStats on every scrape."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self._stats = stats
        self._model = model_name

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        metric = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
        metric.add_metric([self._model], value)
        return metric

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        metric = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
        metric.add_metric([self._model], value)
        return metric

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        yield self._gauge("num_requests_running", "Requests in the running batch.",
                          s.num_requests_running)  # fmt: skip
        yield self._gauge("num_requests_waiting", "Requests waiting to be scheduled.",
                          s.num_requests_waiting)  # fmt: skip
        yield self._gauge("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent.",
                          s.kv_cache_usage)  # fmt: skip
        yield self._counter("prefix_cache_queries", "Prefix-cache queries, in tokens.",
                            s.prefix_cache_queries)  # fmt: skip
        yield self._counter("prefix_cache_hits", "Prefix-cache hits, in tokens.",
                            s.prefix_cache_hits)  # fmt: skip
        yield self._counter("prompt_tokens", "Prefill tokens processed.", s.prompt_tokens_total)
        yield self._counter("generation_tokens", "Generation tokens processed.",
                            s.generation_tokens_total)  # fmt: skip
        yield self._counter("num_preemptions", "Cumulative preemptions.", s.num_preemptions)
        for name in SPEC_COUNTERS:
            value = getattr(s, name, None)
            if value is not None:
                yield self._counter(name, f"Speculative decoding: {name[12:]}.", value)
        per_pos: Any = getattr(s, "spec_decode_num_accepted_tokens_per_pos", None)
        if per_pos is not None:
            metric = CounterMetricFamily(
                PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                "Accepted draft tokens by draft position.",
                labels=["model_name", "position"],
            )
            items = per_pos.items() if isinstance(per_pos, dict) else enumerate(per_pos)
            for position, value in items:
                metric.add_metric([self._model, str(position)], value)
            yield metric


class ServerMetrics:
    """One server's registry: request latency histograms plus the engine collector."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            metric = Histogram(PREFIX + name, doc, ["model_name"], registry=self.registry,
                               buckets=buckets)  # fmt: skip
            return metric.labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.",
                              TTFT_BUCKETS)  # fmt: skip
        self.itl = histogram("inter_token_latency_seconds", "Inter-token latency.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency.",
                             REQUEST_BUCKETS)  # fmt: skip
        self.queue_time = histogram("request_queue_time_seconds",
                                    "Time a request waited before its first schedule.",
                                    REQUEST_BUCKETS)  # fmt: skip
        self.registry.register(_EngineCollector(stats, model_name))

    def render(self) -> bytes:
        return generate_latest(self.registry)
