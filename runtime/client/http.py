"""A small streaming client for OpenAI-compatible servers (ours, vLLM, llama.cpp, trtllm-serve).

It sends one `/v1/completions` or `/v1/chat/completions` request with `stream: true`, reads
the SSE frames (`data: {json}` ... `data: [DONE]`) and times every content chunk, so the
gate's replay and `kiln bench` measure the same way `vllm bench serve` does:

- TTFT: first chunk carrying a token - request sent;
- ITL: the gaps between consecutive content chunks;
- TPOT: (latency - TTFT) / (output tokens - 1), output tokens from the server's `usage`
  (asked for with `stream_options.include_usage`), else the number of content chunks.

Hand-written rather than the `openai` package: that client hides the per-chunk arrival times
behind its iterator and is not a runtime dependency; httpx (which it wraps) is. The SSE
parsing lives in `_Stream`, shared by the sync and the async client.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from itertools import pairwise
from typing import Any

import httpx

from kiln.runtime.base.errors import UsageError

COMPLETIONS = "/v1/completions"
CHAT_COMPLETIONS = "/v1/chat/completions"


@dataclass(slots=True)
class StreamResult:
    """One streamed request: what came back and when (times from `time.perf_counter`)."""

    text: str = ""
    output_tokens: int = 0
    prompt_tokens: int | None = None
    sent_at: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    finished_at: float | None = None
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token: first content chunk - request sent."""
        return self.token_times[0] - self.sent_at if self.token_times else None

    @property
    def latency_s(self) -> float | None:
        """End-to-end latency: request sent - stream ended."""
        return self.finished_at - self.sent_at if self.finished_at is not None else None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, as vLLM's bench defines it."""
        ttft, latency = self.ttft_s, self.latency_s
        if ttft is None or latency is None or self.output_tokens < 2:
            return None
        return (latency - ttft) / (self.output_tokens - 1)

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive content chunks."""
        times = self.token_times
        return [b - a for a, b in pairwise(times)]


class _Stream:
    """Accumulates one response's SSE lines into a StreamResult."""

    def __init__(self, chat: bool) -> None:
        self.chat = chat
        self.result = StreamResult(sent_at=time.perf_counter())
        self._texts: list[str] = []
        self._usage_tokens: int | None = None
        self.done = False

    def feed(self, line: str) -> None:
        """Take one line of the event stream (comments and blank lines are ignored)."""
        if not line.startswith("data:"):
            return
        payload = line[len("data:") :].strip()
        if payload == "[DONE]":
            self.done = True
            return
        now = time.perf_counter()
        event = json.loads(payload)
        if "error" in event and not event.get("choices"):  # an error sent mid-stream
            error = event["error"]
            message = error.get("message", error) if isinstance(error, dict) else error
            self.result.error = f"server error: {message}"
            return
        usage = event.get("usage")
        if usage:
            if usage.get("completion_tokens") is not None:
                self._usage_tokens = int(usage["completion_tokens"])
            if usage.get("prompt_tokens") is not None:
                self.result.prompt_tokens = int(usage["prompt_tokens"])
        arrived = False
        for choice in event.get("choices") or []:
            if self.chat:
                piece = str((choice.get("delta") or {}).get("content") or "")
            else:
                piece = str(choice.get("text") or "")
            finish = choice.get("finish_reason")
            self.result.finish_reason = finish or self.result.finish_reason
            self._texts.append(piece)
            # As vLLM's bench: every chunk is a token arriving, even one whose text is
            # empty (a detokenizer holding back half a character); but not a closing
            # chunk that only carries the finish reason.
            arrived = arrived or bool(piece) or not finish
        if arrived:
            self.result.token_times.append(now)

    def fail(self, message: str) -> StreamResult:
        self.result.error = message
        return self.finish()

    def finish(self) -> StreamResult:
        result = self.result
        result.finished_at = time.perf_counter()
        result.text = "".join(self._texts)
        result.output_tokens = self._usage_tokens or len(result.token_times)
        if result.error is None and not self.done:
            result.error = "stream ended without `data: [DONE]`"
        return result


def base_url(url: str) -> str:
    """The server root of an endpoint URL (`http://h:p/v1/` and `http://h:p` → `http://h:p`)."""
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def streaming_body(body: dict[str, Any], model: str | None) -> dict[str, Any]:
    """A copy of an OpenAI request body that streams and reports usage in the last chunk."""
    out = dict(body)
    if model:
        out["model"] = model
    out["stream"] = True
    out["stream_options"] = {"include_usage": True}
    return out


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _first_model(listed: Any) -> str:
    return str(listed["data"][0]["id"])


def _http_error(status: int, body: bytes) -> str:
    return f"HTTP {status}: {body.decode(errors='replace')[:300]}"


def resolve_model(url: str, model: str | None, api_key: str | None = None) -> str | None:
    """Check that a server answers at `url`; return `model` or the first of its /v1/models.

    A server that cannot be reached raises UsageError (exit 2) naming the URL and the fix.
    """
    where = f"{base_url(url)}/v1/models"
    try:
        resp = httpx.get(where, headers=_headers(api_key), timeout=30.0)
    except httpx.HTTPError as exc:
        raise UsageError(
            f"{url}: no server answers ({type(exc).__name__}: {exc}); start one "
            "(e.g. `kiln serve ARTIFACT --port 8000`) or fix the URL"
        ) from None
    if resp.status_code in (401, 403):
        raise UsageError(f"{url}: HTTP {resp.status_code}; the server wants an API key (--api-key)")
    if model is not None:
        return model
    try:
        return str(resp.raise_for_status().json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        raise UsageError(
            f"{where}: answered HTTP {resp.status_code} without a model list; "
            "pass the model name with --model"
        ) from None


class OpenAIClient:
    """Blocking client: one streamed request at a time per call."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        timeout_s: float = 300.0,
        api_key: str | None = None,
    ) -> None:
        self.base = base_url(url)
        self.model = model
        self._client = httpx.Client(timeout=timeout_s, headers=_headers(api_key))

    def first_model(self) -> str:
        """The first model of /v1/models; raises httpx/ValueError/KeyError on failure."""
        return _first_model(self._client.get(f"{self.base}/v1/models").raise_for_status().json())

    def stream(self, endpoint: str, body: dict[str, Any]) -> StreamResult:
        """Send `body` to `endpoint` with streaming on; failures land in `.error`, not raised."""
        state = _Stream(endpoint == CHAT_COMPLETIONS)
        payload = streaming_body(body, self.model)
        try:
            with self._client.stream("POST", self.base + endpoint, json=payload) as resp:
                if resp.status_code >= 400:
                    return state.fail(_http_error(resp.status_code, resp.read()))
                for line in resp.iter_lines():
                    state.feed(line)
                    if state.done:
                        break
        except (httpx.HTTPError, ValueError) as exc:
            return state.fail(f"{type(exc).__name__}: {exc}")
        return state.finish()

    def close(self) -> None:
        self._client.close()


class AsyncOpenAIClient:
    """asyncio client: many streamed requests in flight on one connection pool."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        timeout_s: float = 300.0,
        api_key: str | None = None,
        max_connections: int = 256,
    ) -> None:
        self.base = base_url(url)
        self.model = model
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=64)
        self._client = httpx.AsyncClient(
            timeout=timeout_s, headers=_headers(api_key), limits=limits
        )

    async def first_model(self) -> str:
        """The first model of /v1/models; raises httpx/ValueError/KeyError on failure."""
        resp = await self._client.get(f"{self.base}/v1/models")
        return _first_model(resp.raise_for_status().json())

    async def stream(self, endpoint: str, body: dict[str, Any]) -> StreamResult:
        """Send `body` to `endpoint` with streaming on; failures land in `.error`, not raised."""
        state = _Stream(endpoint == CHAT_COMPLETIONS)
        payload = streaming_body(body, self.model)
        try:
            async with self._client.stream("POST", self.base + endpoint, json=payload) as resp:
                if resp.status_code >= 400:
                    return state.fail(_http_error(resp.status_code, await resp.aread()))
                async for line in resp.aiter_lines():
                    state.feed(line)
                    if state.done:
                        break
        except (httpx.HTTPError, ValueError) as exc:
            return state.fail(f"{type(exc).__name__}: {exc}")
        return state.finish()

    async def aclose(self) -> None:
        await self._client.aclose()
