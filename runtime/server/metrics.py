"""Prometheus metrics under vLLM 0.32's names, types, buckets and labels (prefix `vllm:`,
labels `model_name` and `engine`), so dashboards and alerts written for vLLM work unchanged;
plus the process and Python collectors and the HTTP metrics of prometheus-fastapi-instrumentator,
as vLLM's server exposes them.

Latency and per-request histograms are observed by the server as each request finishes
(`ServerMetrics.finished`); its phases are the server's view of them: queue time from the
engine, prefill to the first token, decode from it to the last. Gauges, counters, the
iteration-tokens histogram and cache_config_info are read from the engine's EngineStats at
scrape time (a custom collector), so they can never drift from the engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kiln.runtime.engine.outputs import ITERATION_TOKENS_BUCKETS, EngineStats

PREFIX = "vllm:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LABELS = ["model_name", "engine"]
ENGINE = "0"  # one engine per server
# vLLM's buckets (vllm/v1/metrics/buckets.py), so histograms line up across servers.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
N_BUCKETS = (1, 2, 5, 10, 20)
PREEMPTION_BUCKETS = (1, 2, 3, 4, 5, 10, 20)
# vLLM's reasons a request waits ("deferred": LoRA budget, KV transfer; kiln has neither) and
# an admission is refused (kiln's --max-waiting is a queued-requests limit).
WAITING_REASONS = ("capacity", "deferred")
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
# vLLM's FinishReason strings, each counter created at zero.
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
# Read from EngineStats on each scrape: (type, vLLM's name, its documentation, the field).
ENGINE_METRICS = (
    ("gauge", "num_requests_running", "Number of requests in model execution batches.",
     "num_requests_running"),
    ("gauge", "num_requests_waiting", "Number of requests waiting to be processed.",
     "num_requests_waiting"),
    ("gauge", "kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
     "kv_cache_usage"),
    ("counter", "prefix_cache_queries",
     "Prefix cache queries, in terms of number of queried tokens.", "prefix_cache_queries"),
    ("counter", "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
     "prefix_cache_hits"),
    ("counter", "prompt_tokens", "Number of prefill tokens processed.", "prompt_tokens_total"),
    ("counter", "generation_tokens", "Number of generation tokens processed.",
     "generation_tokens_total"),
    ("counter", "num_preemptions", "Cumulative number of preemption from the engine.",
     "num_preemptions"),
)  # fmt: skip
# The server-observed histograms: attribute → (vLLM's name, its documentation).
HISTOGRAMS = {
    "ttft": ("time_to_first_token_seconds", "Histogram of time to first token in seconds."),
    "itl": ("inter_token_latency_seconds", "Histogram of inter-token latency in seconds."),
    "tpot": (
        "request_time_per_output_token_seconds",
        "Histogram of time_per_output_token_seconds per request.",
    ),
    "e2e": ("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."),
    "queue_time": (
        "request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
    ),
    "inference_time": (
        "request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
    ),
    "prefill_time": (
        "request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
    ),
    "decode_time": (
        "request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
    ),
    "prompt_tokens": ("request_prompt_tokens", "Number of prefill tokens processed."),
    "generation_tokens": ("request_generation_tokens", "Number of generation tokens processed."),
    "max_tokens": ("request_params_max_tokens", "Histogram of the max_tokens request parameter."),
    "n": ("request_params_n", "Histogram of the n request parameter."),
    "max_generation_tokens": (
        "request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
    ),
    "preemptions": (
        "request_num_preemptions",
        "Histogram of the number of times a request was preempted.",
    ),
    "prefill_kv_computed": (
        "request_prefill_kv_computed_tokens",
        "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
    ),
}
SPEC_COUNTERS = (
    "spec_decode_num_drafts",
    "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens",
)


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series up to the context length (request token histograms)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class _EngineCollector(Collector):
    """Gauges, counters and the iteration histogram straight from EngineStats on a scrape."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str) -> None:
        self._stats = stats
        self._values = [model_name, ENGINE]

    def _gauge(self, name: str, doc: str, value: float) -> Metric:
        metric = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
        metric.add_metric(self._values, value)
        return metric

    def _counter(self, name: str, doc: str, value: float) -> Metric:
        metric = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
        metric.add_metric(self._values, value)
        return metric

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        for kind, name, doc, field in ENGINE_METRICS:
            make = self._gauge if kind == "gauge" else self._counter
            yield make(name, doc, getattr(s, field))
        waiting = GaugeMetricFamily(
            PREFIX + "num_requests_waiting_by_reason",
            "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
            "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
            "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
            labels=[*LABELS, "reason"],
        )
        capacity, deferred = WAITING_REASONS
        waiting.add_metric([*self._values, capacity], s.num_requests_waiting)
        waiting.add_metric([*self._values, deferred], 0)  # kiln defers nothing
        yield waiting
        if s.iteration_tokens_buckets:
            iteration = HistogramMetricFamily(PREFIX + "iteration_tokens_total",
                                              "Histogram of number of tokens per engine_step.",
                                              labels=LABELS)  # fmt: skip
            bounds = [*(str(float(b)) for b in ITERATION_TOKENS_BUCKETS), "+Inf"]
            running, cumulative = 0, []
            for bound, count in zip(bounds, s.iteration_tokens_buckets, strict=True):
                running += count
                cumulative.append((bound, running))
            iteration.add_metric(self._values, cumulative, sum_value=s.iteration_tokens_sum)
            yield iteration
        if s.cache_config:
            info = GaugeMetricFamily(PREFIX + "cache_config_info",
                                     "Information of the LLMEngine CacheConfig",
                                     labels=[*s.cache_config, "engine"])  # fmt: skip
            info.add_metric([*s.cache_config.values(), ENGINE], 1)
            yield info
        for name in SPEC_COUNTERS:
            value = getattr(s, name, None)
            if value is not None:
                yield self._counter(name, f"Speculative decoding: {name[12:]}.", value)
        per_pos: Any = getattr(s, "spec_decode_num_accepted_tokens_per_pos", None)
        if per_pos is not None:
            metric = CounterMetricFamily(
                PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                "Accepted draft tokens by draft position.",
                labels=[*LABELS, "position"],
            )
            items = per_pos.items() if isinstance(per_pos, dict) else enumerate(per_pos)
            for position, value in items:
                metric.add_metric([*self._values, str(position)], value)
            yield metric


class ServerMetrics:
    """One server's registry: vLLM's request histograms and counters, the engine collector,
    the process/platform/GC collectors (HTTP metrics are added by the app)."""

    def __init__(
        self, stats: Callable[[], EngineStats], model_name: str, max_model_len: int = 2048
    ) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        values = (model_name, ENGINE)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            metric = Histogram(PREFIX + name, doc, LABELS, registry=self.registry,
                               buckets=buckets)  # fmt: skip
            return metric.labels(*values)

        tokens = token_buckets(max_model_len)
        self.ttft = histogram(*HISTOGRAMS["ttft"], TTFT_BUCKETS)
        self.itl = histogram(*HISTOGRAMS["itl"], ITL_BUCKETS)
        self.tpot = histogram(*HISTOGRAMS["tpot"], ITL_BUCKETS)
        self.e2e = histogram(*HISTOGRAMS["e2e"], REQUEST_BUCKETS)
        self.queue_time = histogram(*HISTOGRAMS["queue_time"], REQUEST_BUCKETS)
        self.inference_time = histogram(*HISTOGRAMS["inference_time"], REQUEST_BUCKETS)
        self.prefill_time = histogram(*HISTOGRAMS["prefill_time"], REQUEST_BUCKETS)
        self.decode_time = histogram(*HISTOGRAMS["decode_time"], REQUEST_BUCKETS)
        self.prompt_tokens = histogram(*HISTOGRAMS["prompt_tokens"], tokens)
        self.generation_tokens = histogram(*HISTOGRAMS["generation_tokens"], tokens)
        self.max_tokens = histogram(*HISTOGRAMS["max_tokens"], tokens)
        self.n = histogram(*HISTOGRAMS["n"], N_BUCKETS)
        self.max_generation_tokens = histogram(*HISTOGRAMS["max_generation_tokens"], tokens)
        self.preemptions = histogram(*HISTOGRAMS["preemptions"], PREEMPTION_BUCKETS)
        self.prefill_kv_computed = histogram(*HISTOGRAMS["prefill_kv_computed"], tokens)
        self.prompt_tokens_cached = Counter(
            PREFIX + "prompt_tokens_cached",
            "Number of cached prompt tokens (local + external).",
            LABELS,
            registry=self.registry,
        ).labels(*values)
        rejections = Counter(
            PREFIX + "admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=self.registry,
        )
        self.admission_rejections = {r: rejections.labels(model_name, r) for r in ADMISSION_REASONS}
        success = Counter(
            PREFIX + "request_success",
            "Count of successfully processed requests.",
            [*LABELS, "finished_reason"],
            registry=self.registry,
        )
        self.success = {r: success.labels(*values, r) for r in FINISH_REASONS}
        self.registry.register(_EngineCollector(stats, model_name))
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            self.registry.register(collector)

    def finished(
        self,
        reason: str | None,
        prompt_tokens: int,
        generation_tokens: int,
        max_tokens: int,
        e2e: float,
        queue: float | None,
        ttft: float | None,
        decode: float | None,
        cached_tokens: int = 0,
        preemptions: int = 0,
    ) -> None:
        """Observe one finished request (one choice), as vLLM observes a finished request."""
        self.success.get(reason or "abort", self.success["abort"]).inc()
        self.e2e.observe(e2e)
        self.prompt_tokens.observe(prompt_tokens)
        self.generation_tokens.observe(generation_tokens)
        self.max_tokens.observe(max_tokens)
        self.preemptions.observe(preemptions)
        self.prompt_tokens_cached.inc(max(cached_tokens, 0))
        self.prefill_kv_computed.observe(prompt_tokens - max(cached_tokens, 0))
        queued = queue or 0.0
        if queue is not None:
            self.queue_time.observe(queue)
        self.inference_time.observe(max(e2e - queued, 0.0))
        if ttft is not None:
            self.prefill_time.observe(max(ttft - queued, 0.0))
        if decode is not None:
            self.decode_time.observe(decode)
            if generation_tokens > 1:
                self.tpot.observe(decode / (generation_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
