"""Running one request's choices on the backend: per-choice streams, metrics, disconnects.

A choice's async generator aborts its engine request in `finally`, so every way out
(finished, client gone, task cancelled, error) frees its KV blocks. Non-streaming
requests watch the ASGI receive channel for `http.disconnect` while they wait and cancel
the generation when the client leaves; streaming responses are cancelled by Starlette.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from starlette.requests import Request

from kiln.runtime.engine.sampling import SamplingParams
from kiln.runtime.server.formatting import ChoiceResult
from kiln.runtime.server.state import ServerState

T = TypeVar("T")


@dataclasses.dataclass(slots=True)
class ChoiceSpec:
    index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


def choice_specs(
    request_id: str, prompts: list[list[int]], params: SamplingParams, n: int
) -> list[ChoiceSpec]:
    """One engine request per (prompt, sample); with a seed, sample j uses seed + j so the
    n samples differ but stay reproducible."""
    specs = []
    for p, ids in enumerate(prompts):
        for j in range(n):
            own = params
            if n > 1 and params.seed is not None:
                own = dataclasses.replace(params, seed=params.seed + j)
            index = p * n + j
            specs.append(ChoiceSpec(index, f"{request_id}-{index}", ids, own))
    return specs


async def stream_choice(
    state: ServerState, spec: ChoiceSpec, result: ChoiceResult
) -> AsyncIterator[ChoiceResult]:
    """Yield `result` after each delta, updated in place (new text in `result.delta`)."""
    backend, metrics = state.backend, state.metrics
    result.sent = result.sent or time.perf_counter()
    gen = backend.generate(spec.prompt_ids, spec.params, spec.request_id)
    finished = False
    queue: float | None = None
    try:
        async for out in gen:
            now = time.perf_counter()
            if out.queue_time is not None:
                queue = out.queue_time
            if out.prompt_logprobs is not None:
                result.prompt_logprobs = list(out.prompt_logprobs)
            if out.token_ids:
                if result.first is None:
                    result.first = now
                    metrics.ttft.observe(now - result.sent)
                elif result.last is not None:
                    gap = (now - result.last) / len(out.token_ids)
                    for _ in out.token_ids:
                        metrics.itl.observe(gap)
                result.last = now
            result.token_ids += out.token_ids
            result.logprobs += out.logprobs or []
            result.text += out.text
            result.delta = out.text
            result.delta_tokens = list(out.token_ids)
            result.delta_logprobs = list(out.logprobs or [])
            if out.finished:
                result.finish_reason = out.finish_reason
                result.stop_reason = out.stop_reason
                result.done = True
                finished = True
                first = result.first
                metrics.finished(
                    out.finish_reason, len(spec.prompt_ids), len(result.token_ids),
                    spec.params.max_tokens, now - result.sent, queue,
                    None if first is None else first - result.sent,
                    None if first is None else now - first,
                    out.num_cached_tokens, out.num_preemptions,
                )  # fmt: skip
            yield result
    finally:
        if not finished:  # before any await: a cancelled task may not get past one
            backend.abort(spec.request_id)
            metrics.success["abort"].inc()
        await gen.aclose()  # type: ignore[attr-defined]


async def collect_choice(state: ServerState, spec: ChoiceSpec, sent: float) -> ChoiceResult:
    result = ChoiceResult(spec.index, spec.prompt_ids, sent=sent)
    async for _ in stream_choice(state, spec, result):
        pass
    return result


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await `work`; if the client disconnects first, cancel it and return None."""
    task: asyncio.Future[T] = asyncio.ensure_future(work)
    watcher: asyncio.Future[Any] = asyncio.ensure_future(_wait_disconnect(request))
    try:
        waiting: set[asyncio.Future[Any]] = {task, watcher}
        done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def body_dict(body: Any) -> dict[str, Any]:
    """A request model as the JSON the client sent (unset fields left out)."""
    return dict(body.model_dump(exclude_unset=True, mode="json"))
