"""What callers see: per-request outputs (whole or as streaming deltas) and engine stats."""

from __future__ import annotations

from dataclasses import dataclass, field

from kiln.runtime.engine.sampling import Logprob
from kiln.runtime.engine.sequence import FINISH_REASONS, Request


@dataclass(slots=True)
class RequestOutput:
    """What a caller sees of a request: the whole output so far, or a delta when streaming.

    `finish_reason` is None while running, else "stop", "length" or "abort"; `stop_reason`
    is the stop string or token id that ended it, if any.
    """

    request_id: str
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    # Seconds from arrival to its first schedule (vLLM's queue time); None until scheduled.
    queue_time: float | None = None
    num_preemptions: int = 0  # how often the scheduler has preempted it so far


def queue_time(request: Request) -> float | None:
    if request.first_scheduled_time is None:
        return None
    return max(0.0, request.first_scheduled_time - request.arrival_time)


# vLLM's buckets for the tokens of one engine step (vllm/v1/metrics/buckets.py).
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


@dataclass(slots=True)
class EngineStats:
    """Gauges and counters, named after vLLM's metrics."""

    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float
    num_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    prompt_tokens_total: int
    generation_tokens_total: int
    num_preemptions: int
    num_steps: int
    busy_seconds: float
    # Speculative decoding (vLLM's spec_decode counters): draft passes, tokens proposed,
    # tokens accepted, and accepted counts by draft position (position 0 first).
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # Tokens each step computed, as counts per bucket of ITERATION_TOKENS_BUCKETS (the last
    # one above them all), and their sum: vLLM's iteration_tokens_total histogram.
    iteration_tokens_buckets: list[int] = field(default_factory=list)
    iteration_tokens_sum: int = 0
    # What vLLM's cache_config_info reports: block size, blocks, cache dtype, prefix caching.
    cache_config: dict[str, str] = field(default_factory=dict)

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens per verifying pass, vLLM's 1 + accepted / drafts (1.0 with no drafts)."""
        drafts = self.spec_decode_num_drafts
        return 1.0 + self.spec_decode_num_accepted_tokens / drafts if drafts else 1.0

    @property
    def generation_throughput(self) -> float:
        """Output tokens per second of time spent inside `step`."""
        return self.generation_tokens_total / self.busy_seconds if self.busy_seconds else 0.0


def delta_output(request: Request) -> RequestOutput:
    """What the request produced since its last delta (text held back while it could
    still turn out to begin a stop string)."""
    visible = len(request.text)
    if not request.finished and request.params.stop:
        visible -= max(len(s) for s in request.params.stop) - 1
    visible = max(visible, request.sent_text_len)
    first = request.sent_tokens == 0
    out = RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        text=request.text[request.sent_text_len : visible],
        token_ids=request.output_token_ids[request.sent_tokens :],
        finished=request.finished,
        finish_reason=FINISH_REASONS.get(request.status),
        stop_reason=request.stop_reason,
        logprobs=(
            request.logprobs[request.sent_tokens :] if request.params.logprobs is not None else None
        ),
        prompt_logprobs=(
            request.prompt_logprobs
            if first and request.params.prompt_logprobs is not None
            else None
        ),
        num_cached_tokens=request.num_cached_tokens,
        queue_time=queue_time(request),
        num_preemptions=request.num_preemptions,
    )
    request.sent_text_len = visible
    request.sent_tokens = request.num_output_tokens
    return out


def final_output(request: Request) -> RequestOutput:
    """The whole output of a request so far."""
    params = request.params
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        text=request.text,
        token_ids=list(request.output_token_ids),
        finished=request.finished,
        finish_reason=FINISH_REASONS.get(request.status),
        stop_reason=request.stop_reason,
        logprobs=request.logprobs if params.logprobs is not None else None,
        prompt_logprobs=request.prompt_logprobs if params.prompt_logprobs is not None else None,
        num_cached_tokens=request.num_cached_tokens,
        queue_time=queue_time(request),
        num_preemptions=request.num_preemptions,
    )
