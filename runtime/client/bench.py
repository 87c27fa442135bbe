"""`kiln bench`: a load generator and latency report for any OpenAI-compatible server.

The measurements follow `vllm bench serve` so numbers compare across servers: every request
streams (runtime.client), TTFT and end-to-end latency are per request, TPOT =
(latency - TTFT) / (output tokens - 1) over requests with at least two tokens, ITL pools the
gaps between content chunks of every request, throughput divides by the wall time from the
first send to the last completion, and goodput counts the requests per second that met every
SLO given. Percentiles are numpy's (linear interpolation), as vLLM's.

Load is either a fixed number of requests in flight (`concurrency`), Poisson arrivals at
`request_rate` per second (exponential gaps, seeded), or both (arrivals wait for a free
slot). With neither, every request is sent at once, as vLLM's default `--request-rate inf`.

Fixed output lengths ask the server to ignore EOS (`ignore_eos`, `min_tokens`: vLLM,
llama.cpp's llama-server, trtllm-serve and kiln accept them); `short_outputs` counts the
successful requests that still came back shorter, i.e. a server that ignored the request.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kiln.runtime.base.errors import UsageError
from kiln.runtime.client.bench_report import SLO, BenchReport, summarize
from kiln.runtime.client.http import (
    CHAT_COMPLETIONS,
    COMPLETIONS,
    AsyncOpenAIClient,
    StreamResult,
    resolve_model,
)
from kiln.runtime.formats.traffic import read_traffic

# Plain words for synthetic prompts: any tokenizer splits them into a predictable number of
# tokens, and random draws keep prompts distinct so a prefix cache cannot shortcut them.
_WORD_TEXT = (
    "the of and to in is was for on that with as by at from his her they this which have "
    "river stone garden window letter market winter summer morning evening village mountain "
    "teacher doctor farmer captain painter soldier student writer singer sailor engine "
    "bridge castle forest island harbour kitchen library station theatre valley meadow "
    "quickly slowly quietly bright dark warm cold green blue golden silver ancient modern "
    "walked carried opened listened watched wrote built found followed remembered answered "
    "story question answer reason number history music science water light paper bread"
)
_WORDS = _WORD_TEXT.split()


@dataclass(slots=True)
class BenchRequest:
    """One request to send: its endpoint and OpenAI body (without model and stream)."""

    endpoint: str
    body: dict[str, Any]
    prompt_tokens: int | None = None  # known when built with a tokenizer


def poisson_arrivals(count: int, rate: float | None, seed: int = 0) -> list[float]:
    """Send times (s after start) of a Poisson process: exponential gaps of mean 1/rate.

    The first request goes at 0; rate None or inf sends everything at 0.
    """
    if rate is None or math.isinf(rate):
        return [0.0] * count
    if not rate > 0:
        raise UsageError(f"--request-rate {rate}: must be > 0 requests per second (or inf)")
    draw = random.Random(seed)
    times, now = [], 0.0
    for _ in range(count):
        times.append(now)
        now += draw.expovariate(rate)
    return times


def _fixed_length(body: dict[str, Any], output_len: int, ignore_eos: bool) -> dict[str, Any]:
    out = {**body, "max_tokens": output_len}
    if ignore_eos:
        out.update(ignore_eos=True, min_tokens=output_len)
    return out


def _as_request(endpoint: str, prompt: str, extra: dict[str, Any]) -> BenchRequest:
    if endpoint == CHAT_COMPLETIONS:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": prompt}]}
    else:
        body = {"prompt": prompt}
    return BenchRequest(endpoint, {**body, **extra})


def synthetic_requests(
    count: int,
    input_len: int,
    output_len: int,
    *,
    tokenizer_dir: str | Path | None = None,
    chat: bool = False,
    ignore_eos: bool = True,
    seed: int = 0,
) -> list[BenchRequest]:
    """`count` distinct prompts of `input_len` tokens (with a tokenizer) or words (without)."""
    if input_len < 1 or output_len < 1:
        raise UsageError("--input-len and --output-len must be at least 1")
    tokenizer = None
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer  # only for token-exact prompt lengths

        tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    draw = random.Random(seed)
    endpoint = CHAT_COMPLETIONS if chat else COMPLETIONS
    requests = []
    for _ in range(count):
        words = [draw.choice(_WORDS) for _ in range(input_len)]
        text, known = " ".join(words), None
        if tokenizer is not None:  # every word is at least one token: cut to exactly input_len
            ids = tokenizer(text, add_special_tokens=False)["input_ids"][:input_len]
            text, known = str(tokenizer.decode(ids)), len(ids)
        request = _as_request(endpoint, text, {"temperature": 0.0})
        request.body = _fixed_length(request.body, output_len, ignore_eos)
        request.prompt_tokens = known
        requests.append(request)
    return requests


def file_requests(
    path: str | Path,
    *,
    output_len: int | None = None,
    chat: bool = False,
    ignore_eos: bool = True,
) -> list[BenchRequest]:
    """Requests from a traffic file (JSON lines, runtime.traffic) or a file of prompt lines.

    Recorded requests keep their own settings unless `output_len` fixes every length; a
    recorded list of prompts becomes one request per prompt. Plain lines are sent greedy to
    /v1/completions (or as one user message each with `chat`).
    """
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--prompts {path}: file not found")
    lines = path.read_text(encoding="utf-8").splitlines()
    first = next((line.strip() for line in lines if line.strip()), "")
    if not first:
        raise UsageError(f"--prompts {path}: the file has no prompts")
    requests: list[BenchRequest] = []
    if first.startswith("{"):
        for record in read_traffic(path):
            bodies = [record.request]
            if not record.is_chat and not isinstance(record.request["prompt"], str):
                bodies = [{**record.request, "prompt": p} for p in record.request["prompt"]]
            requests += [BenchRequest(record.endpoint, dict(b)) for b in bodies]
    else:
        endpoint = CHAT_COMPLETIONS if chat else COMPLETIONS
        limit = {"max_tokens": output_len or 128, "temperature": 0.0}
        requests = [_as_request(endpoint, line, limit) for line in lines if line.strip()]
    if output_len is not None:
        for request in requests:
            request.body = _fixed_length(request.body, output_len, ignore_eos)
    return requests


def repeat_to(requests: list[BenchRequest], count: int) -> list[BenchRequest]:
    """Cycle through `requests` until there are `count` of them."""
    if not requests:
        raise UsageError("no requests to send")
    return [requests[i % len(requests)] for i in range(count)]


async def _send_all(
    requests: list[BenchRequest],
    client: AsyncOpenAIClient,
    concurrency: int | None,
    arrivals: list[float],
) -> tuple[list[StreamResult], float]:
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    start = time.perf_counter()

    async def one(request: BenchRequest, at: float) -> StreamResult:
        wait = start + at - time.perf_counter()
        if wait > 0:
            await asyncio.sleep(wait)
        if slots is None:
            return await client.stream(request.endpoint, request.body)
        async with slots:
            return await client.stream(request.endpoint, request.body)

    results = await asyncio.gather(*(one(r, t) for r, t in zip(requests, arrivals, strict=True)))
    return list(results), time.perf_counter() - start


def run_bench(
    url: str,
    requests: list[BenchRequest],
    *,
    model: str | None = None,
    concurrency: int | None = None,
    request_rate: float | None = None,
    slo: SLO | None = None,
    seed: int = 0,
    timeout_s: float = 600.0,
    api_key: str | None = None,
) -> BenchReport:
    """Send `requests` to the server at `url` under the given load; errors are counted."""
    if concurrency is not None and concurrency < 1:
        raise UsageError(f"--concurrency {concurrency}: must be at least 1")
    rate = None if request_rate is None or math.isinf(request_rate) else request_rate
    arrivals = poisson_arrivals(len(requests), rate, seed)
    model = resolve_model(url, model, api_key)
    width = concurrency or max(1, len(requests))

    async def main() -> tuple[list[StreamResult], float]:
        client = AsyncOpenAIClient(url, model, timeout_s, api_key, max_connections=width)
        try:
            return await _send_all(requests, client, concurrency, arrivals)
        finally:
            await client.aclose()

    results, duration = asyncio.run(main())
    return summarize(
        results,
        duration,
        slo=slo,
        expected_output=[r.body.get("min_tokens") for r in requests],
        input_tokens=[r.prompt_tokens for r in requests],
        url=url,
        model=model,
        concurrency=concurrency,
        request_rate=rate,
    )
