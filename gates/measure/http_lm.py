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

A request the server refuses (a context shorter than an item, say), or an answer that is not
what was asked (gates/measure/openai_answers.py checks every number where it enters), raises
`NotMeasured` with the server's own words or the fault found, so the check it belonged to is
reported as not measured on that engine, never scored from a partial or impossible answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from kiln.gates.measure.lm_eval_adapter import DEFAULT_MAX_LENGTH, Generation, ScoringLM
from kiln.gates.measure.openai_answers import (
    NotMeasured,
    completion_choices,
    echo_logprobs,
    generated_text,
    prompt_logprobs,
)
from kiln.gates.measure.served import Served

__all__ = ["HttpLM", "NotMeasured"]

BATCH = 8  # prompts per scoring request
CONCURRENCY = 4  # requests in flight
TIMEOUT_S = 600.0
# The mean |Δ log-probability| one engine may show between a prompt scored with top-k and
# without (batching rounds bf16 differently; a model's scores do not move further).
CONSISTENT = 0.05


class HttpLM(ScoringLM):
    """An lm-eval model whose scores and generations come from a served model."""

    def __init__(
        self,
        served: Served,
        tokenizer: Any,
        max_length: int | None = None,
        batch_size: int = BATCH,
        concurrency: int = CONCURRENCY,
        vocab_size: int | None = None,
        timeout_s: float = TIMEOUT_S,
    ) -> None:
        limit = (served.max_model_len or DEFAULT_MAX_LENGTH) - 2
        super().__init__(tokenizer, min(int(max_length or DEFAULT_MAX_LENGTH), limit), batch_size)
        self.served = served
        self.concurrency, self.timeout_s = concurrency, timeout_s
        # Token ids an answer may name: the model's rows (a padded vocabulary holds more
        # than the tokenizer's).
        self.vocab_size = max(len(tokenizer), vocab_size or 0)
        headers = {"Authorization": f"Bearer {served.api_key}"} if served.api_key else {}
        self._client = httpx.Client(base_url=served.url, headers=headers, timeout=self.timeout_s)
        # Set once a request went unanswered for timeout_s: the engine has stalled, and every
        # later request is not measured at once instead of waiting as long again.
        self._stalled: str | None = None

    def close(self) -> None:
        self._client.close()

    def _post(self, body: dict[str, Any], count: int) -> list[dict[str, Any]]:
        """The `count` choices of a completion request, in prompt order."""
        if self._stalled is not None:
            raise NotMeasured(self._stalled)
        try:
            resp = self._client.post("/v1/completions", json={"model": self.served.model, **body})
        except httpx.TimeoutException as exc:
            self._stalled = (
                f"the server stopped answering: a request got no answer in {self.timeout_s:g} s "
                f"({exc.__class__.__name__}), so kiln asked it nothing more"
            )
            raise NotMeasured(self._stalled) from None
        except httpx.HTTPError as exc:
            raise NotMeasured(
                f"the server did not answer ({exc.__class__.__name__}: {exc})"
            ) from None
        if resp.status_code != 200:
            raise NotMeasured(f"the server refused a request ({resp.status_code}: "
                              f"{resp.text[:300]})")  # fmt: skip
        try:
            data = resp.json()
        except ValueError:
            raise NotMeasured(f"the server's answer is not JSON ({resp.text[:200]!r})") from None
        return completion_choices(data, count, self.served.model)

    def _parallel(self, work: Sequence[Any], fn: Callable[[Any], list[Any]]) -> list[Any]:
        with ThreadPoolExecutor(max_workers=self.concurrency) as pool:
            return [item for chunk in pool.map(fn, work) for item in chunk]

    def _item(self, prompt: list[int]) -> str:
        """How an answer's fault names the item it was for: its start, as text."""
        text = self.tokenizer.decode(prompt[:12])
        return f"the {len(prompt)}-token prompt starting {text[:60]!r}"

    def _prompt_logprobs(
        self, prompts: Sequence[list[int]], top_k: int = 0, starts: Sequence[int] | None = None
    ) -> list[Any]:
        caps = self.served.capabilities
        need = "topk" if top_k else "scores"
        why = caps.missing(need)
        if why is not None:
            raise NotMeasured(why)  # the verdict names the engine beside it
        starts = list(starts) if starts is not None else [1] * len(prompts)
        batches = [
            list(range(b, min(b + self.batch_size, len(prompts))))
            for b in range(0, len(prompts), self.batch_size)
        ]

        def one(batch: list[int]) -> list[Any]:
            ids = [list(prompts[i]) for i in batch]
            if caps.prompt_logprobs:
                choices = self._post({"prompt": ids, "max_tokens": 1, "temperature": 0,
                                      "prompt_logprobs": top_k}, len(ids))  # fmt: skip
                rows = [
                    prompt_logprobs(c.get("prompt_logprobs"), p, self.vocab_size, self._item(p))
                    for c, p in zip(choices, ids, strict=True)
                ]
            else:
                choices = self._post({"prompt": ids, "max_tokens": 1, "temperature": 0,
                                      "echo": True, "logprobs": 1}, len(ids))  # fmt: skip
                rows = [
                    echo_logprobs(c.get("logprobs"), p, self._item(p))
                    for c, p in zip(choices, ids, strict=True)
                ]
            return [
                [None if pos < max(1, starts[i]) else row[pos] for pos in range(len(prompts[i]))]
                for i, row in zip(batch, rows, strict=True)
            ]

        return self._parallel(batches, one)

    def checked_topk(
        self, token_ids: Sequence[list[int]], k: int
    ) -> tuple[list[list[dict[int, float]]], str | None]:
        """`topk_logprobs`, and why the engine's scores cannot be trusted, or None: the same
        prompts are scored again without top-k, and each prompt token must get the same
        log-probability both ways (an engine whose tasks' scores and top-k answers disagree
        is not measuring one model)."""
        with_top = self._prompt_logprobs(token_ids, top_k=k)
        plain = self._prompt_logprobs(token_ids, top_k=0)
        gaps = [
            abs(a[pos][token].logprob - b[pos][token].logprob)
            for ids, a, b in zip(token_ids, with_top, plain, strict=True)
            for pos, token in enumerate(ids)
            if pos >= 1
        ]
        mean = sum(gaps) / len(gaps) if gaps else 0.0
        problem = None
        if mean > CONSISTENT:
            problem = (
                f"it gave the divergence texts' tokens log-probabilities {mean:.3g} apart on "
                f"average (at most {max(gaps):.3g}) when asked with top-{k} and without: its "
                "scores are not one model's"
            )
        top = [
            [{t: e.logprob for t, e in entry.items() if e.rank <= k} for entry in row[1:]]
            for row in with_top
        ]
        return top, problem

    def _generate(self, requests: Sequence[Generation]) -> list[str]:
        def one(request: Generation) -> list[str]:
            body = {"prompt": request.prompt, "max_tokens": request.max_tokens,
                    "temperature": request.temperature}  # fmt: skip
            if request.stop:
                body["stop"] = request.stop
            return [generated_text(self._post(body, 1)[0])]

        return self._parallel(list(requests), one)
