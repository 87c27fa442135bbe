"""`/v1/completions` and `/v1/chat/completions`: validate, admit, generate, answer (JSON or
SSE), then record and mirror the finished request.

Tokenising and checking a prompt runs on a worker thread: a prompt of megabytes takes
seconds to tokenise, and the event loop must keep answering /health and other requests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool

from kiln.runtime.engine.sampling import SamplingParams
from kiln.runtime.formats.mirror_log import MirrorEntry
from kiln.runtime.formats.side_answer import SideAnswer
from kiln.runtime.formats.traffic import CHAT_COMPLETIONS, COMPLETIONS
from kiln.runtime.server import formatting as fmt
from kiln.runtime.server.auth import require_api_key
from kiln.runtime.server.backends.native import Backend
from kiln.runtime.server.formatting import ChoiceResult
from kiln.runtime.server.generation import (
    ChoiceSpec,
    body_dict,
    choice_specs,
    collect_choice,
    stream_choice,
    unless_disconnected,
)
from kiln.runtime.server.mirror import MirrorJob
from kiln.runtime.server.protocol import ChatCompletionRequest, CompletionRequest, new_id, now
from kiln.runtime.server.record import prompt_digest
from kiln.runtime.server.state import APIError, ServerState

ChunkFn = Callable[[ChoiceResult, bool], dict[str, Any] | None]


def _state(request: Request) -> ServerState:
    state: ServerState = request.app.state.kiln
    return state


def _check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.config.model_name:
        raise APIError(404, f"the model `{model}` does not exist; this server serves "
                       f"`{state.config.model_name}` (see /v1/models)", "model_not_found",
                       "model")  # fmt: skip


def _check_room(state: ServerState, prompt_ids: list[int], max_tokens: int, param: str) -> None:
    """400 when the prompt and the tokens asked for pass the context, as OpenAI answers,
    rather than generating until the context is full."""
    context = state.backend.max_model_len
    if len(prompt_ids) + max_tokens > context:
        raise APIError(400, f"this model's context is {context} tokens: the prompt has "
                       f"{len(prompt_ids)} and `{param}` asks for {max_tokens} more; lower "
                       f"{param} to at most {context - len(prompt_ids)} or shorten the prompt",
                       param=param)  # fmt: skip


def _check_bytes(backend: Backend, text: str, param: str) -> None:
    """Refuse, before tokenising it, a text longer in bytes than the model's whole context
    could hold (tokenizers.py bounds the bytes one token stands for)."""
    limit = backend.max_model_len
    if backend.tokens.too_long(text, limit):
        size = len(text.encode(errors="replace"))
        raise APIError(400, f"{param} is {size:,} bytes: more than the model's {limit:,}-token "
                       f"context can hold (at most {backend.tokens.max_token_bytes} bytes a "
                       "token); shorten it", param=param)  # fmt: skip


def register(app: FastAPI) -> None:
    """Add the two generation routes to `app`."""
    auth = [Depends(require_api_key)]
    app.post("/v1/completions", dependencies=auth)(completions)
    app.post("/v1/chat/completions", dependencies=auth)(chat_completions)


async def completions(body: CompletionRequest, request: Request) -> Response:
    """POST /v1/completions: one choice per prompt and `n`, JSON or SSE."""
    state = _state(request)
    _check_model(state, body.model)
    params, drop = body.sampling_params()
    prompts = body.prompts()
    backend = state.backend
    rid = new_id("cmpl")

    def tokenise() -> tuple[list[list[int]], list[str]]:
        for text in prompts:
            if isinstance(text, str):
                _check_bytes(backend, text, "prompt")
        ids = [backend.tokens.encode(p) if isinstance(p, str) else p for p in prompts]
        for prompt_ids in ids:
            backend.validate(prompt_ids, params, rid)
            _check_room(state, prompt_ids, params.max_tokens, "max_tokens")
        if not body.echo:
            return ids, []
        return ids, [p if isinstance(p, str) else backend.tokens.decode(p) for p in prompts]

    ids, echo = await run_in_threadpool(tokenise)
    texts = [p if isinstance(p, str) else None for p in prompts]
    top_n = body.logprobs or 0
    sent_chars: dict[int, int] = {}  # streaming: characters sent so far, per choice

    def choice(result: ChoiceResult, delta: bool) -> dict[str, Any]:
        first = not delta or result.first_chunk
        text = result.delta if delta else result.text
        tokens = result.delta_tokens if delta else result.token_ids
        entries: list[Any] = result.delta_logprobs if delta else result.logprobs
        if drop:
            text, tokens, entries = "", [], []
        toks: list[int] = []
        lps: list[Any] = []
        if body.echo and first:
            prompt_no = result.index // body.n
            text = echo[prompt_no] + text
            toks += result.prompt_ids
            lps += result.prompt_logprobs or [None] * len(result.prompt_ids)
        logprobs = None
        # Streamed, text_offset goes on from the text already sent (vLLM: 0, 6, 7, 8 ...).
        offset = sent_chars.get(result.index, 0) if delta else 0
        if body.logprobs is not None:
            head = backend.tokens.decode(toks[:1]) if lps and lps[0] is None else None
            logprobs = fmt.completion_logprobs(toks + tokens, lps + entries, top_n, head, offset)
        if delta:
            sent_chars[result.index] = offset + len(text)
        finish = ("length" if drop else result.finish_reason) if result.done else None
        stop_reason = result.stop_reason if finish else None
        out = {"index": result.index, "text": text, "logprobs": logprobs,
               "finish_reason": finish, "stop_reason": stop_reason}  # fmt: skip
        # vLLM scores the prompt for echo with logprobs and returns that as prompt_logprobs too.
        prompt_top = body.prompt_logprobs
        if prompt_top is None and body.echo and body.logprobs is not None:
            prompt_top = body.logprobs
        if delta and body.echo and first:  # vLLM's first echoed chunk names the prompt's ids
            out["prompt_token_ids"] = list(result.prompt_ids)
        if prompt_top is not None and not delta:  # vLLM's stream chunks carry none
            entries = result.prompt_logprobs or [None] * len(result.prompt_ids)
            out["prompt_logprobs"] = fmt.prompt_logprobs(result.prompt_ids, entries, prompt_top)
        return out

    def chunk(result: ChoiceResult, delta: bool) -> dict[str, Any] | None:
        return {"object": "text_completion", "choices": [choice(result, delta)]}

    return await _respond(
        request, state, body, COMPLETIONS, rid, ids, params, chunk,
        lambda results: [choice(r, False) for r in results],
        texts, drop,
    )  # fmt: skip


async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    """POST /v1/chat/completions: the chat rendered by the model's template, JSON or SSE."""
    state = _state(request)
    _check_model(state, body.model)
    backend = state.backend
    messages = body.template_messages()
    rid = new_id("chatcmpl")

    def tokenise() -> tuple[list[int], SamplingParams]:
        _check_bytes(backend, "".join(m["content"] for m in messages), "messages")
        ids = backend.tokens.chat_ids(messages, body.add_generation_prompt)
        params = body.sampling_params(backend.max_model_len - len(ids))
        backend.validate(ids, params, rid)
        limit = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        _check_room(state, ids, params.max_tokens, limit)
        return ids, params

    ids, params = await run_in_threadpool(tokenise)
    top_n = body.top_logprobs or 0

    def logprobs(tokens: list[int], entries: list[Any]) -> dict[str, Any] | None:
        return fmt.chat_logprobs(tokens, entries, top_n) if body.logprobs else None

    def chunk(result: ChoiceResult, delta: bool) -> dict[str, Any] | None:
        content: dict[str, Any] = {"content": result.delta}
        finish = result.finish_reason if result.done else None
        if not result.delta and finish is None:
            return None
        choice = {"index": result.index, "delta": content, "finish_reason": finish,
                  "logprobs": logprobs(result.delta_tokens, result.delta_logprobs)}  # fmt: skip
        if finish is not None:  # vLLM sends stop_reason on a choice's last chunk only
            choice["stop_reason"] = result.stop_reason
        return {"object": "chat.completion.chunk", "choices": [choice]}

    def opening(index: int) -> dict[str, Any]:
        """vLLM's and OpenAI's first chunk of each choice: the role, no content yet."""
        delta = {"role": "assistant", "content": ""}
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        return {"object": "chat.completion.chunk", "choices": [choice]}

    def choices(results: list[ChoiceResult]) -> list[dict[str, Any]]:
        return [
            {
                "index": r.index,
                "message": {"role": "assistant", "content": r.text},
                "logprobs": logprobs(r.token_ids, r.logprobs),
                "finish_reason": r.finish_reason,
                "stop_reason": r.stop_reason,
            }
            for r in results
        ]

    prompt_text = "\n".join(m["content"] for m in messages)
    return await _respond(
        request, state, body, CHAT_COMPLETIONS, rid, [ids], params, chunk,
        choices, [prompt_text], False, messages=messages, opening=opening,
    )  # fmt: skip


async def _respond(
    request: Request,
    state: ServerState,
    body: CompletionRequest | ChatCompletionRequest,
    endpoint: str,
    rid: str,
    prompts: list[list[int]],
    params: Any,
    chunk: ChunkFn,
    choices: Callable[[list[ChoiceResult]], list[dict[str, Any]]],
    prompt_texts: list[str | None],
    drop: bool,
    messages: list[dict[str, str]] | None = None,
    opening: Callable[[int], dict[str, Any]] | None = None,
) -> Response:
    specs = choice_specs(rid, prompts, params, body.n)
    state.admit(len(specs))
    state.metrics.n.observe(body.n)
    sent = time.perf_counter()
    head = {"id": rid, "created": now(), "model": state.config.model_name}
    prompt_tokens = sum(len(p) for p in prompts)

    def final(results: list[ChoiceResult]) -> dict[str, Any]:
        completion = 0 if drop else sum(len(r.token_ids) for r in results)
        kind = "chat.completion" if endpoint == CHAT_COMPLETIONS else "text_completion"
        return {**head, "object": kind, "choices": choices(results),
                "system_fingerprint": state.fingerprint,
                "usage": fmt.usage(prompt_tokens, completion)}  # fmt: skip

    def after(results: list[ChoiceResult]) -> None:
        # vLLM's request_max_num_generation_tokens: per prompt, the most any of its n made
        for start in range(0, len(results), body.n):
            group = results[start : start + body.n]
            state.metrics.max_generation_tokens.observe(max(len(r.token_ids) for r in group))
        response = final(results)
        _record(state, rid, endpoint, body, prompt_tokens, response, results, prompts)
        if not drop:
            _mirror(state, rid, endpoint, body, prompts, prompt_texts, params, results, messages)

    if not body.stream:
        try:
            gathered = await unless_disconnected(
                request, asyncio.gather(*(collect_choice(state, s, sent) for s in specs))
            )
        finally:
            state.release(len(specs))
        if gathered is None:  # the client left; its requests were aborted
            return Response(status_code=499)
        results = sorted(gathered, key=lambda r: r.index)
        after(results)
        return JSONResponse(final(results))

    release = _Once(lambda: state.release(len(specs)))
    stream_kind = "chat.completion.chunk" if endpoint == CHAT_COMPLETIONS else "text_completion"
    frames = _sse(state, specs, sent, head, chunk, body.include_usage, final, after, release,
                  stream_kind, opening, state.fingerprint)  # fmt: skip
    return _ReleasingStream(
        frames,
        release,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache"},
    )


class _Once:
    """Call a function at most once, however many paths end a response."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


class _ReleasingStream(StreamingResponse):
    """A streaming response that gives back its admission slots however it ends: a client
    that leaves before the body starts never runs the body generator's `finally`."""

    def __init__(self, content: AsyncIterator[str], release: _Once, **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._release = release

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._release()


async def _sse(
    state: ServerState,
    specs: list[ChoiceSpec],
    sent: float,
    head: dict[str, Any],
    chunk: ChunkFn,
    include_usage: bool,
    final: Callable[[list[ChoiceResult]], dict[str, Any]],
    after: Callable[[list[ChoiceResult]], None],
    release: Callable[[], None],
    kind: str,
    opening: Callable[[int], dict[str, Any]] | None,
    fingerprint: str,
) -> AsyncIterator[str]:
    """Interleave every choice's deltas as SSE frames (after each choice's `opening` frame,
    where the endpoint has one); the usage-only chunk, where asked, is of the stream's
    object `kind`; `data: [DONE]` last. As vLLM's, the stream's last frames carry the
    `system_fingerprint`: the usage chunk where there is one, else each choice's last."""
    results = [ChoiceResult(s.index, s.prompt_ids, sent=sent) for s in specs]
    frames: asyncio.Queue[dict[str, Any] | BaseException | None] = asyncio.Queue()

    async def pump(spec: ChoiceSpec, result: ChoiceResult) -> None:
        try:
            async for r in stream_choice(state, spec, result):
                frame = chunk(r, True)
                r.first_chunk = False
                if frame is not None:
                    await frames.put({**head, **frame})
        except Exception as exc:
            await frames.put(exc)
        finally:
            await frames.put(None)

    tasks = [asyncio.ensure_future(pump(s, r)) for s, r in zip(specs, results, strict=True)]
    try:
        if opening is not None:
            for spec in specs:
                yield fmt.sse({**head, **opening(spec.index)})
        running = len(tasks)
        while running:
            item = await frames.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                yield fmt.sse({"error": {"message": str(item), "type": "server_error",
                                         "param": None, "code": 500}})  # fmt: skip
                return
            else:
                if not include_usage and any(c.get("finish_reason") for c in item["choices"]):
                    item["system_fingerprint"] = fingerprint
                yield fmt.sse(item)
        if include_usage:
            usage = final(results)["usage"]
            yield fmt.sse({**head, "object": kind, "choices": [], "usage": usage,
                           "system_fingerprint": fingerprint})  # fmt: skip
        yield fmt.sse("[DONE]")
        after(results)
    finally:
        # No await in here: a client that left cancels this generator, and under Starlette's
        # cancel scope any await would be cancelled again before the release ran.
        release()
        for task in tasks:
            task.cancel()  # each choice's stream aborts its engine request as it unwinds


def _record(
    state: ServerState,
    rid: str,
    endpoint: str,
    body: Any,
    prompt_tokens: int,
    response: dict[str, Any],
    results: list[ChoiceResult],
    prompts: list[list[int]],
) -> None:
    recorder = state.recorder
    if recorder is None or not recorder.sample():
        return
    data = body_dict(body)
    decoded = None
    if endpoint == COMPLETIONS and not isinstance(data.get("prompt"), str):
        first = data.get("prompt") or [None]
        if not isinstance(first[0], str):  # token ids: traffic readers want text
            decoded = [state.backend.tokens.decode(p) for p in prompts]
    first_tokens = [r.ttft_s for r in results if r.ttft_s is not None]
    extra = {
        "usage": response["usage"],
        "latency_s": round(time.perf_counter() - min(r.sent for r in results), 6),
        "ttft_s": round(min(first_tokens), 6) if first_tokens else None,
        "finish_reasons": [c.get("finish_reason") for c in response["choices"]],
    }
    recorder.write(rid, endpoint, data, prompt_tokens, response, extra, decoded)


def _mirror(
    state: ServerState,
    rid: str,
    endpoint: str,
    body: Any,
    prompts: list[list[int]],
    prompt_texts: list[str | None],
    params: Any,
    results: list[ChoiceResult],
    messages: list[dict[str, str]] | None,
) -> None:
    mirror = state.mirror
    if mirror is None or len(results) != 1 or not mirror.sample():
        return
    [result] = results
    data = body_dict(body)
    content = data.pop("messages" if messages is not None else "prompt", None)
    for key in ("stream", "stream_options", "echo", "logprobs", "top_logprobs"):
        data.pop(key, None)
    text = prompt_texts[0]
    if not state.config.store_prompts or text is None:
        text = f"<redacted sha256:{prompt_digest(content)}>"
    primary = SideAnswer(result.text, list(result.token_ids), result.ttft_s, result.tpot_s,
                         result.finish_reason, model=state.config.model_name,
                         digest=state.extra.get("digest", ""))  # fmt: skip
    entry = MirrorEntry(rid, time.time(), endpoint, text, data, primary)
    prompt = prompt_texts[0] if prompt_texts[0] is not None else prompts[0]
    job = MirrorJob(entry, None if messages is not None else prompt, messages,
                    _greedy_equal(params))  # fmt: skip
    mirror.offer(job)


def _greedy_equal(params: Any) -> Any:
    # The candidate decodes with exactly the primary's settings (seed included); logprobs
    # are not compared, so they are not asked for.
    import dataclasses

    return dataclasses.replace(params, logprobs=None, prompt_logprobs=None)
