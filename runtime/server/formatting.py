"""OpenAI response bodies from engine outputs: choices, log-probabilities, usage, SSE frames."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kiln.runtime.engine.sampling import Logprob

LogprobEntry = dict[int, Logprob]


@dataclass(slots=True)
class ChoiceResult:
    """Everything one choice produced, gathered from its deltas."""

    index: int
    prompt_ids: list[int]
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    prompt_logprobs: list[LogprobEntry | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it
    done: bool = False
    first_chunk: bool = True  # streaming: nothing sent for this choice yet
    # The latest delta, for streaming.
    delta: str = ""
    delta_tokens: list[int] = field(default_factory=list)
    delta_logprobs: list[LogprobEntry] = field(default_factory=list)
    sent: float = 0.0  # perf_counter when admitted
    first: float | None = None
    last: float | None = None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def tpot_s(self) -> float | None:
        n = len(self.token_ids)
        if self.first is None or self.last is None or n < 2:
            return None
        return (self.last - self.first) / (n - 1)


def sse(payload: dict[str, Any] | str) -> str:
    """One server-sent event frame."""
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _text(entry: LogprobEntry, token: int) -> str:
    return entry[token].decoded_token or ""


def _top(entry: LogprobEntry, n: int) -> list[tuple[int, Logprob]]:
    """The n most likely tokens of an entry (it also holds the chosen one), best first."""
    return sorted(entry.items(), key=lambda item: item[1].rank)[:n]


def completion_logprobs(
    tokens: list[int],
    entries: list[LogprobEntry | None],
    top_n: int,
    first_text: str | None = None,
    offset: int = 0,
) -> dict[str, Any]:
    """The legacy completions `logprobs` object: tokens, token_logprobs, top_logprobs,
    text_offset (from `offset`, the characters a stream sent before these). An entry of None
    (the first prompt token, whose text is `first_text`) gives null log-probabilities, as
    OpenAI does."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                           "text_offset": []}  # fmt: skip
    for token, entry in zip(tokens, entries, strict=True):
        text = _text(entry, token) if entry is not None else (first_text or "")
        out["tokens"].append(text)
        out["text_offset"].append(offset)
        offset += len(text)
        if entry is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        out["token_logprobs"].append(entry[token].logprob)
        top = {_text(entry, t): lp.logprob for t, lp in _top(entry, top_n)}
        top.setdefault(_text(entry, token), entry[token].logprob)
        out["top_logprobs"].append(top)
    return out


def prompt_logprobs(
    prompt_ids: list[int], entries: list[LogprobEntry | None], top_n: int
) -> list[Any]:
    """vLLM's `prompt_logprobs` of a completion choice: per prompt token None (the first) or
    {token id: {logprob, rank, decoded_token}} holding the top `top_n` and the prompt's own
    token; JSON turns the ids into strings, as vLLM's answers have them."""
    out: list[Any] = []
    for token, entry in zip(prompt_ids, entries, strict=True):
        if entry is None:
            out.append(None)
            continue
        out.append({str(t): {"logprob": lp.logprob, "rank": lp.rank,
                             "decoded_token": lp.decoded_token}
                    for t, lp in entry.items() if lp.rank <= top_n or t == token})  # fmt: skip
    return out


def chat_logprobs(tokens: list[int], entries: list[LogprobEntry], top_n: int) -> dict[str, Any]:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def item(text: str, value: float) -> dict[str, Any]:
        return {"token": text, "logprob": value, "bytes": list(text.encode())}

    content = []
    for token, entry in zip(tokens, entries, strict=True):
        head = item(_text(entry, token), entry[token].logprob)
        head["top_logprobs"] = [item(_text(entry, t), lp.logprob) for t, lp in _top(entry, top_n)]
        content.append(head)
    return {"content": content}


def prompt_token_texts(entries: list[LogprobEntry | None], prompt_ids: list[int]) -> list[str]:
    """Each prompt token's text, where the prompt log-probabilities name it."""
    return [_text(e, t) if e is not None else "" for e, t in zip(entries, prompt_ids, strict=True)]
