"""lm-eval requests answered by an OpenAI-compatible server: the gate's tasks and top-k
log-probabilities on the engine that ships a model (vLLM, trtllm-serve, `kiln serve`, any URL).

`HttpLM` is `ScoringLM` (gates/measure/lm_eval_adapter.py) with its two primitives sent over
HTTP, so contexts, continuations and rolling windows are tokenised exactly as for kiln's
runtime in process, with the side's own tokenizer, and sent as token ids:
- prompt log-probabilities through `/v1/completions` with `prompt_logprobs: k` (vLLM's
  extension: each prompt token's id, logprob and rank, and the top k) where the server has
  it, else lm-eval's `local-completions` convention, `echo: true` + `logprobs: 1` (each
  prompt token's logprob and the top-1's; greedy when they are equal). Top-k ids for the
  KL need the first; loglikelihood scores either;
- generation greedily (temperature 0) with the request's stop strings, one request each.

A request the server refuses (a context shorter than an item, say) raises `NotMeasured`
with the server's own words, so the check it belonged to is reported as not measured on
that engine, never scored from a partial answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx

from kiln.gates.measure.lm_eval_adapter import DEFAULT_MAX_LENGTH, Generation, ScoringLM
from kiln.gates.measure.served import Served

BATCH = 8  # prompts per scoring request
CONCURRENCY = 4  # requests in flight
TIMEOUT_S = 600.0


class NotMeasured(Exception):
    """The server cannot answer what a check needs; `reason` says why, in its words."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Entry:
    """One token's log-probability and rank at a prompt position (rank 1: most likely;
    under the echo convention, 1 when it is the top-1 and 2 otherwise)."""

    logprob: float
    rank: int


class HttpLM(ScoringLM):
    """An lm-eval model whose scores and generations come from a served model."""

    def __init__(
        self,
        served: Served,
        tokenizer: Any,
        max_length: int | None = None,
        batch_size: int = BATCH,
        concurrency: int = CONCURRENCY,
    ) -> None:
        limit = (served.max_model_len or DEFAULT_MAX_LENGTH) - 2
        super().__init__(tokenizer, min(int(max_length or DEFAULT_MAX_LENGTH), limit), batch_size)
        self.served = served
        self.concurrency = concurrency
        headers = {"Authorization": f"Bearer {served.api_key}"} if served.api_key else {}
        self._client = httpx.Client(base_url=served.url, headers=headers, timeout=TIMEOUT_S)

    def close(self) -> None:
        self._client.close()

    def _post(self, body: dict[str, Any]) -> list[dict[str, Any]]:
        try:
            resp = self._client.post("/v1/completions", json={"model": self.served.model, **body})
        except httpx.HTTPError as exc:
            raise NotMeasured(
                f"the server did not answer ({exc.__class__.__name__}: {exc})"
            ) from None
        if resp.status_code != 200:
            raise NotMeasured(f"the server refused a request ({resp.status_code}: "
                              f"{resp.text[:300]})")  # fmt: skip
        try:
            return sorted(resp.json()["choices"], key=lambda c: c["index"])
        except (ValueError, KeyError, TypeError):
            raise NotMeasured(
                f"the server's answer is not an OpenAI completion ({resp.text[:200]!r})"
            ) from None

    def _parallel(self, work: Sequence[Any], fn: Callable[[Any], list[Any]]) -> list[Any]:
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return [item for chunk in pool.map(fn, work) for item in chunk]

    def _prompt_logprobs(
        self, prompts: Sequence[list[int]], top_k: int = 0, starts: Sequence[int] | None = None
    ) -> list[Any]:
        caps = self.served.capabilities
        need = "topk" if top_k else "scores"
        why = caps.missing(need)
        if why is not None:
            raise NotMeasured(f"{self.served.engine} {self.served.version}: {why}")
        starts = list(starts) if starts is not None else [1] * len(prompts)
        batches = [
            list(range(b, min(b + self.batch_size, len(prompts))))
            for b in range(0, len(prompts), self.batch_size)
        ]

        def one(batch: list[int]) -> list[Any]:
            ids = [list(prompts[i]) for i in batch]
            if caps.prompt_logprobs:
                choices = self._post({"prompt": ids, "max_tokens": 1, "temperature": 0,
                                      "prompt_logprobs": top_k})  # fmt: skip
                rows = [_from_prompt_logprobs(c.get("prompt_logprobs")) for c in choices]
            else:
                choices = self._post({"prompt": ids, "max_tokens": 1, "temperature": 0,
                                      "echo": True, "logprobs": 1})  # fmt: skip
                rows = [_from_echo(c.get("logprobs"), p) for c, p in zip(choices, ids, strict=True)]
            short = len(rows) != len(ids) or any(
                len(r) < len(p) for r, p in zip(rows, ids, strict=True)
            )
            if short:
                raise NotMeasured("the server returned fewer prompt log-probabilities than tokens")
            return [
                [None if pos < max(1, starts[i]) else row[pos] for pos in range(len(prompts[i]))]
                for i, row in zip(batch, rows, strict=True)
            ]

        return self._parallel(batches, one)

    def _generate(self, requests: Sequence[Generation]) -> list[str]:
        def one(request: Generation) -> list[str]:
            body = {"prompt": request.prompt, "max_tokens": request.max_tokens,
                    "temperature": request.temperature}  # fmt: skip
            if request.stop:
                body["stop"] = request.stop
            return [str(self._post(body)[0]["text"])]

        return self._parallel(list(requests), one)


def _from_prompt_logprobs(entries: list[Any] | None) -> list[dict[int, Entry] | None]:
    """vLLM's prompt_logprobs (ids as strings) → per position {id: Entry}."""
    out: list[dict[int, Entry] | None] = []
    for entry in entries or []:
        if entry is None:
            out.append(None)
            continue
        row = {}
        for token, value in entry.items():
            rank = value.get("rank")
            row[int(token)] = Entry(float(value["logprob"]), int(rank) if rank else 10**9)
        out.append(row)
    return out


def _from_echo(logprobs: dict[str, Any] | None, prompt: list[int]) -> list[dict[int, Entry] | None]:
    """lm-eval's echo convention → per position {the prompt's token: Entry}: rank 1 when its
    logprob is the top-1's (the greedy test lm-eval's local-completions makes)."""
    values = (logprobs or {}).get("token_logprobs") or []
    tops = (logprobs or {}).get("top_logprobs") or []
    out: list[dict[int, Entry] | None] = []
    for position, token in enumerate(prompt):
        value = values[position] if position < len(values) else None
        if value is None:
            out.append(None)
            continue
        top = tops[position] if position < len(tops) and tops[position] else {}
        best = max(top.values(), default=value)
        out.append({token: Entry(float(value), 1 if value >= best else 2)})
    return out
