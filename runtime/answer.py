"""One side's answer to one request, and how an engine gives it with nothing else running.

`SideAnswer` is what the gate's shadow comparison reads: the gate's replay gets answers from
endpoints and engines (gates/sides.py), and `kiln serve --mirror` logs the primary's and the
candidate's (server/mirror_log.py). `answer_alone` runs one request through an engine that no
one else is stepping, so its timings are the engine's own: TTFT from the request's arrival
(before tokenisation) to its first token, TPOT = (end - first token) / (tokens - 1).

Standard library only at import: the gate reads mirror logs without torch.
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from kiln.runtime.errors import UsageError

Chat = list[dict[str, str]]


@dataclass(slots=True)
class SideAnswer:
    """One side's answer to one request; `error` set means it failed to answer. `model` and
    `digest` name the side where a log keeps the answers of two."""

    text: str = ""
    token_ids: list[int] | None = None
    ttft_s: float | None = None
    tpot_s: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    model: str = ""
    digest: str = ""


def chat_token_ids(
    tokenizer: Any, messages: Chat, lock: AbstractContextManager[Any] | None = None
) -> list[int]:
    """Render a chat with the tokenizer's template and tokenise it without adding special
    tokens again (the template writes them); `lock` guards the tokenizer if it is shared.
    UsageError when there is no template or it refuses the messages."""
    if not getattr(tokenizer, "chat_template", None):
        raise UsageError(
            "this model's tokenizer has no chat template; use /v1/completions or serve a "
            "model whose tokenizer_config.json sets chat_template"
        )
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # jinja raises TemplateError for chats the template refuses
        raise UsageError(f"the chat template refused these messages: {exc}") from None
    with lock or nullcontext():
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])


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
