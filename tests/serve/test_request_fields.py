"""The request fields of OpenAI's and vLLM's schemas against `kiln serve`: each one kiln
implements changes the output as vLLM's does (checked against transformers' own logits
processors where it has the same one), and each one it does not is a 400 naming it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from kiln.runtime import Engine
from kiln.runtime.engine.sampling import SamplingParams, process_logits
from kiln.runtime.server.protocol import REFUSED
from tests.runtime.conftest import hf_model, prompt_ids
from tests.serve.conftest import MODEL, LiveServer


def completion(server: LiveServer, **body: Any) -> dict[str, Any]:
    payload = {"model": MODEL, "temperature": 0, "max_tokens": 12, "ignore_eos": True, **body}
    resp = httpx.post(f"{server.url}/v1/completions", json=payload, timeout=60)
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def free_run(model_dir: Path, prompt: list[int]) -> list[int]:
    """The tiny model's greedy continuation, from the runtime in process (the server's)."""
    engine = Engine.from_pretrained(model_dir)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    return engine.generate([prompt], params)[0].token_ids


def test_repetition_penalty_is_transformers_repetition_penalty(
    shared_server: LiveServer, tiny_llama: Path
) -> None:
    """Greedy under repetition_penalty 1.5 equals transformers' generate with its
    RepetitionPenaltyLogitsProcessor (the same rule as vLLM's: prompt and output tokens,
    positive logits divided, negative multiplied)."""
    prompt = prompt_ids(tiny_llama, 1)[0]
    with torch.no_grad():
        out = hf_model(tiny_llama).generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
            pad_token_id=0, repetition_penalty=1.5,
        )  # fmt: skip
    expected = AutoTokenizer.from_pretrained(tiny_llama).decode(out[0, len(prompt) :].tolist())
    plain = completion(shared_server, prompt=prompt)["choices"][0]["text"]
    penalised = completion(shared_server, prompt=prompt, repetition_penalty=1.5)["choices"][0]
    # (a trailing partial UTF-8 character is held back by the server until it completes)
    assert penalised["text"] == expected.rstrip("\ufffd")
    assert penalised["text"] != plain  # the penalty changed this continuation


def test_logit_bias_min_tokens_and_stop_token_ids(shared_server: LiveServer, tiny_llama: Path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = prompt_ids(tiny_llama, 1)[0]
    forced = completion(shared_server, prompt=prompt, logit_bias={"42": 100})["choices"][0]
    assert forced["text"] == tokenizer.decode([42] * 12).rstrip("\ufffd")
    # A stop token at the free run's third token ends it there, its text left out as vLLM
    # leaves it out (unless include_stop_str_in_output) ...
    free = free_run(tiny_llama, prompt)
    stop_id = free[2]
    assert stop_id not in free[:2]
    body = {"prompt": prompt, "stop_token_ids": [stop_id], "ignore_eos": False}
    stopped = completion(shared_server, **body)["choices"][0]
    assert stopped["finish_reason"] == "stop"
    assert stopped["text"] == tokenizer.decode(free[:2])
    kept = completion(shared_server, **body, include_stop_str_in_output=True)["choices"][0]
    assert kept["text"] == tokenizer.decode(free[:3]).rstrip("\ufffd")
    # ... and min_tokens 6 holds it off for six tokens (vLLM: the stop token at -inf).
    held = completion(shared_server, **body, min_tokens=6, logprobs=0)["choices"][0]
    pieces = held["logprobs"]["tokens"]
    assert len(pieces) >= 6 and tokenizer.decode([stop_id]) not in pieces[:6]
    # more min_tokens than max_tokens is refused, as vLLM refuses it, not quietly lowered
    payload = {"model": MODEL, "prompt": prompt, "max_tokens": 4, "min_tokens": 5}
    resp = httpx.post(f"{shared_server.url}/v1/completions", json=payload, timeout=60)
    assert resp.status_code == 400 and "min_tokens" in resp.text


def test_stop_strings_after_min_tokens_and_include_stop_str(shared_server: LiveServer, tiny_llama):
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    prompt = prompt_ids(tiny_llama, 1)[0]
    free = free_run(tiny_llama, prompt)
    stop = tokenizer.decode(free[2:3])
    before = tokenizer.decode(free[:2])
    assert stop.strip() and stop not in before
    cut = completion(shared_server, prompt=prompt, stop=[stop])["choices"][0]
    assert cut["text"] == before and cut["finish_reason"] == "stop"
    kept = completion(shared_server, prompt=prompt, stop=[stop], include_stop_str_in_output=True)
    assert kept["choices"][0]["text"] == before + stop
    # vLLM checks stop strings only once min_tokens are out: min_tokens 3 runs past this one.
    late = completion(shared_server, prompt=prompt, stop=[stop], min_tokens=3)["choices"][0]
    assert late["text"].startswith(tokenizer.decode(free[:3]))


def test_presence_frequency_penalties_and_min_p_follow_vllms_rules() -> None:
    """process_logits and the sampler's min-p against the rules vLLM states, on numbers."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    out = process_logits(logits, [params], [[0]], [[3, 3, 1]], [frozenset()])
    # token 0 (prompt): 2 / 2; token 3 (output twice): 3 / 2 - 0.25 * 2 - 0.5;
    # token 1 (output once): -1 * 2 - 0.25 - 0.5; tokens 2 and 4 untouched.
    torch.testing.assert_close(out, torch.tensor([[1.0, -2.75, 0.5, 0.5, 0.0]]))
    assert logits[0, 0] == 2.0  # the raw logits (what logprobs report) are left alone
    from kiln.runtime.engine.sampling import probabilities

    probs = probabilities(torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]])),
                          [SamplingParams(min_p=0.2)])  # fmt: skip
    # min_p 0.2 of the top 0.5 keeps tokens with p >= 0.1: the first three, renormalised.
    torch.testing.assert_close(probs, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


def test_add_generation_prompt_false_leaves_the_assistant_turn_closed(
    shared_server: LiveServer,
) -> None:
    messages = [{"role": "user", "content": "hi"}]
    usage = []
    for flag in (True, False):
        body = {"model": MODEL, "messages": messages, "max_tokens": 1,
                "add_generation_prompt": flag}  # fmt: skip
        resp = httpx.post(f"{shared_server.url}/v1/chat/completions", json=body, timeout=60)
        assert resp.status_code == 200, resp.text
        usage.append(resp.json()["usage"]["prompt_tokens"])
    assert usage[0] > usage[1]  # "<|im_start|>assistant\n" is only in the first


NOT_OFF = {
    "best_of": 2, "use_beam_search": True, "length_penalty": 0.5, "allowed_token_ids": [1],
    "bad_words": ["x"], "guided_json": {}, "guided_regex": "a+", "guided_choice": ["a"],
    "guided_grammar": "g", "structured_outputs": {"json": {}}, "logits_processors": ["x"],
    "truncate_prompt_tokens": 4, "spaces_between_special_tokens": False,
    "return_tokens_as_token_ids": True, "return_token_ids": True, "priority": 1,
    "chat_template": "{{ x }}", "chat_template_kwargs": {"a": 1}, "documents": [{"a": "b"}],
    "continue_final_message": True, "add_special_tokens": True, "tool_choice": "auto",
    "functions": [{"name": "f"}], "function_call": "auto", "parallel_tool_calls": 1,
    "prediction": {"type": "content"}, "audio": {"voice": "x"}, "modalities": ["audio"],
    "reasoning_effort": "low", "web_search_options": {}, "mm_processor_kwargs": {"a": 1},
    "kv_transfer_params": {},
}  # fmt: skip


def test_every_refused_field_is_listed_with_a_value_that_is_not_off() -> None:
    assert set(NOT_OFF) == set(REFUSED)


@pytest.mark.parametrize("field", sorted(REFUSED))
@pytest.mark.parametrize("route", ["completions", "chat/completions"])
def test_a_field_kiln_does_not_implement_is_a_400_naming_it(
    shared_server: LiveServer, route: str, field: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 2, field: NOT_OFF[field]}
    if route == "completions":
        body["prompt"] = "hello"
    else:
        body["messages"] = [{"role": "user", "content": "hello"}]
    resp = httpx.post(f"{shared_server.url}/v1/{route}", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == field and field in error["message"]
    # Its "off" values pass.
    off = (
        next(v for v in REFUSED[field][0] if v is not None) if len(REFUSED[field][0]) > 1 else None
    )
    if off is not None:
        body[field] = off
        assert (
            httpx.post(f"{shared_server.url}/v1/{route}", json=body, timeout=60).status_code == 200
        )


def sse_frames(server: LiveServer, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    frames = []
    with httpx.stream("POST", f"{server.url}/v1/{route}", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                frames.append(json.loads(line.removeprefix("data: ")))
    return frames


def test_streamed_chunks_have_vllms_shape(shared_server: LiveServer, tiny_llama: Path) -> None:
    """A chat stream opens each choice with a role-only chunk; the usage-only chunk is of the
    stream's own object; a completion stream's text_offset runs on across chunks."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    frames = sse_frames(shared_server, "chat/completions", chat)
    assert frames[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all("role" not in f["choices"][0]["delta"] for f in frames[1:-1])
    assert frames[-1]["choices"] == [] and frames[-1]["usage"]["completion_tokens"] == 4
    assert {f["object"] for f in frames} == {"chat.completion.chunk"}
    prompt = prompt_ids(tiny_llama, 1)[0]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    frames = sse_frames(shared_server, "completions", body)
    assert {f["object"] for f in frames} == {"text_completion"}
    offsets, texts = [], []
    for frame in frames[:-1]:
        offsets += frame["choices"][0]["logprobs"]["text_offset"]
        texts += frame["choices"][0]["logprobs"]["tokens"]
    assert offsets == [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    assert offsets[-1] > 0


def test_queue_time_is_observed(shared_server: LiveServer) -> None:
    before = _count(shared_server, "vllm:request_queue_time_seconds_count")
    completion(shared_server, prompt="hello", max_tokens=2)
    assert _count(shared_server, "vllm:request_queue_time_seconds_count") == before + 1


def _count(server: LiveServer, name: str) -> float:
    text = httpx.get(f"{server.url}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name))  # fmt: skip
