"""The scheduler: which requests advance this step, and by how many tokens.

One mechanism, as in vLLM v1: each step hands out a token budget (`max_num_batched_tokens`)
so that every request's computed tokens catch up with its prompt + output tokens. Running
requests are served first (a decode needs one token, a prefill chunk up to the remaining
budget), then waiting requests are admitted after a prefix-cache lookup while the budget,
`max_num_seqs` and the block pool allow. When the pool runs dry, the newest running request
(or, with the priority policy, the lowest-priority one) is preempted: its blocks are freed,
their hashes kept so they stay prefix-cache candidates, and it goes back to the front of the
waiting queue to be recomputed.

With `long_prefill_token_threshold` set, one request's prefill chunk per step is capped at
it (decodes are one token), so a long prompt shares every step with the decodes of the
running requests and the prefills of new ones instead of holding whole steps.

With speculative decoding a running request may carry k draft tokens: it is scheduled for
1 + k tokens (the target verifies them all in this step's forward) when the budget and the
pool allow, and otherwise drops its drafts and decodes one token.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from kiln.runtime.engine.config import EngineConfig
from kiln.runtime.engine.kv_cache import KVCacheManager
from kiln.runtime.engine.sequence import Request, RequestStatus


class WaitingQueue:
    """Requests not running: FIFO, or a heap on (priority, arrival) with the priority policy."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._order = itertools.count()

    def __len__(self) -> int:
        return len(self._fifo) + len(self._heap)

    def push(self, request: Request, front: bool = False) -> None:
        if self.policy == "fcfs":
            if front:
                self._fifo.appendleft(request)
            else:
                self._fifo.append(request)
        else:
            key = (request.priority, request.arrival_time, next(self._order), request)
            heapq.heappush(self._heap, key)

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][3]

    def pop(self) -> Request:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.remove(request)
        else:
            self._heap = [item for item in self._heap if item[3] is not request]
            heapq.heapify(self._heap)


@dataclass(slots=True)
class SchedulerOutput:
    """This step's work: requests with their new-token counts, and who was preempted."""

    requests: list[Request] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def total_tokens(self) -> int:
        return sum(self.num_new_tokens)


class Scheduler:
    """Continuous batching with chunked prefill, prefix caching and preemption by recompute."""

    def __init__(self, config: EngineConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting = WaitingQueue(config.scheduling_policy)
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.push(request)

    def has_unfinished(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0

    def schedule(self) -> SchedulerOutput:
        """Pick this step's requests and token counts; allocates their KV blocks."""
        budget = self.config.max_num_batched_tokens
        scheduled: dict[Request, int] = {}
        preempted: list[Request] = []
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_new = min(self._chunk(request.num_tokens - request.num_computed_tokens), budget)
            if request.spec_token_ids:
                # Verify the draft tokens too when budget and blocks allow; else decode one.
                wanted = num_new + len(request.spec_token_ids)
                if wanted <= budget and self.kv.allocate_slots(request, wanted):
                    scheduled[request] = wanted
                    budget -= wanted
                    index += 1
                    continue
                request.drop_spec()
            while not self.kv.allocate_slots(request, num_new):
                victim = self._victim()
                position = self.running.index(victim)
                self.running.pop(position)
                budget += scheduled.pop(victim, 0)
                self._preempt(victim)
                preempted.append(victim)
                if position < index:
                    index -= 1
                if victim is request:
                    break
            else:
                scheduled[request] = num_new
                budget -= num_new
                index += 1

        # Admitting new work while evicting running work would only thrash.
        while (
            not preempted
            and len(self.waiting) > 0
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting.peek()
            computed = self.kv.get_computed_blocks(request)
            num_cached = len(computed) * self.kv.block_size
            num_new = request.num_tokens - num_cached
            # Without chunked prefill a prompt goes in whole; a preempted request's recompute
            # (prompt + output) may exceed the budget, so it is chunked regardless.
            whole = not self.config.enable_chunked_prefill and request.num_preemptions == 0
            if num_new > budget and whole:
                break
            num_new = min(num_new if whole else self._chunk(num_new), budget)
            if not self.kv.allocate_slots(request, num_new, computed):
                break
            self.waiting.pop()
            self.kv.stats.queries += request.num_tokens
            self.kv.stats.hits += num_cached
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_cached
            request.num_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            if request.first_scheduled_time is None:  # the end of its queueing time
                request.first_scheduled_time = time.monotonic()
            self.running.append(request)
            scheduled[request] = num_new
            budget -= num_new

        return SchedulerOutput(list(scheduled), list(scheduled.values()), preempted)

    def _chunk(self, remaining: int) -> int:
        """How many of a request's `remaining` tokens one step may take, budget aside."""
        cap = self.config.long_prefill_token_threshold
        if cap is None or not self.config.enable_chunked_prefill:
            return remaining
        return min(remaining, cap)

    def _victim(self) -> Request:
        if self.config.scheduling_policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.drop_spec()
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(request, front=True)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Take a request out of the running or waiting set and release its blocks at once."""
        if request in self.running:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
