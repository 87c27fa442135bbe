"""How an engine answers one request with nothing else running (the gate's replay, the
mirror's candidate): `answer_alone` runs one request through an engine that no one else is
stepping, so its timings are the engine's own: TTFT from the request's arrival (before
tokenisation) to its first token, TPOT = (end - first token) / (tokens - 1).
"""

from __future__ import annotations

import time
from typing import Any

from kiln.runtime.base.errors import UsageError
from kiln.runtime.engine.chat import Chat, chat_token_ids
from kiln.runtime.formats.side_answer import SideAnswer


def answer_alone(
    engine: Any,
    params: Any,
    prompt: str | list[int] | None = None,
    messages: Chat | None = None,
) -> SideAnswer:
    """Run one request, a prompt (text or token ids) or a chat, through `engine` (a
    runtime Engine that nothing else steps meanwhile) with SamplingParams `params`."""
    sent = time.perf_counter()
    try:
        if messages is not None:
            prompt = chat_token_ids(engine.tokenizer, messages)
        if prompt is None:
            raise UsageError("a request needs a prompt or chat messages")
        rid = engine.add_request(prompt, params)
    except UsageError as exc:
        return SideAnswer(error=f"bad request: {exc.message}")
    texts: list[str] = []
    tokens: list[int] = []
    first: float | None = None
    finish = None
    done = False
    while not done:
        outputs = engine.step()
        if not outputs and not engine.has_unfinished_requests():
            return SideAnswer("".join(texts), tokens, error="the engine dropped the request")
        for out in outputs:
            if out.request_id != rid:
                continue
            if out.token_ids and first is None:
                first = time.perf_counter()
            texts.append(out.text)
            tokens += out.token_ids
            done, finish = out.finished, out.finish_reason
    end = time.perf_counter()
    ttft = first - sent if first is not None else None
    tpot = (end - first) / (len(tokens) - 1) if first is not None and len(tokens) > 1 else None
    return SideAnswer("".join(texts), tokens, ttft, tpot, finish)
