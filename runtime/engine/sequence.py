"""Request: one prompt's journey through the engine, and the record handed back to callers.

A request carries its tokens, how many of them have KV entries (`num_computed_tokens`), its
block table, and what it has produced so far. The scheduler only ever moves
`num_computed_tokens` toward `num_tokens`; prefill, chunked prefill, decode and recompute
after preemption are all that one motion.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from kiln.runtime.engine.sampling import Logprob, SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(slots=True, eq=False)
class Request:
    """A prompt, its sampling parameters, and its progress through the engine."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    # Physical block ids, in order; block_table[i] holds tokens [i*bs, (i+1)*bs).
    block_table: list[int] = field(default_factory=list)
    # Chained hashes of the full blocks of all_token_ids; kept across preemption.
    block_hashes: list[bytes] = field(default_factory=list)
    generator: torch.Generator | None = None
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    prompt_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    first_scheduled_time: float | None = None  # monotonic, when it first left the queue
    # Speculative decoding: draft tokens to verify next step (not in all_token_ids) and,
    # for sampled requests with a draft model, the draft's distribution at each [k, vocab].
    spec_token_ids: list[int] = field(default_factory=list)
    spec_probs: torch.Tensor | None = None
    # Incremental detokenisation state (see Detokenizer).
    text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0
    sent_text_len: int = 0
    sent_tokens: int = 0

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status.finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True until every prompt token after the first has its log-probability."""
        return (
            self.params.prompt_logprobs is not None
            and len(self.prompt_logprobs) < self.num_prompt_tokens
        )

    def drop_spec(self) -> None:
        """Forget the pending draft tokens (the step decodes one token instead)."""
        self.spec_token_ids = []
        self.spec_probs = None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
