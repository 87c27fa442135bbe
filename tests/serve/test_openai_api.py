"""The official `openai` client against a live `kiln serve` app: completions and chat,
streaming and not, usage, logprobs, /v1/models, /metrics."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kiln.runtime import Engine, SamplingParams
from tests.serve.conftest import MODEL, LiveServer

PROMPT = "Permission is hereby granted, free of charge"


@pytest.fixture(scope="module")
def client(shared_server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shared_server.url}/v1", api_key="unused", max_retries=0)


def _engine_greedy(model_dir: Path, prompt: str | list[int], max_tokens: int) -> str:
    engine = Engine.from_pretrained(model_dir, max_model_len=128, num_threads=1)
    [out] = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return out.text


def test_completion_matches_the_engine_and_counts_usage(
    client: openai.OpenAI, tiny_llama: Path
) -> None:
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    [choice] = out.choices
    assert choice.text == _engine_greedy(tiny_llama, PROMPT, 8)
    assert choice.finish_reason == "length"
    prompt_tokens = len(AutoTokenizer.from_pretrained(tiny_llama).encode(PROMPT))
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (prompt_tokens, 8)
    assert out.usage.total_tokens == prompt_tokens + 8
    assert out.model == MODEL and out.object == "text_completion"


def test_streamed_completion_equals_the_whole_one(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and set(finishes[:-1]) <= {None}
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == 10


def test_sse_ends_with_done(shared_server: LiveServer) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream("POST", f"{shared_server.url}/v1/completions", json=body) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        frames = [line for line in resp.iter_lines() if line]
    assert all(f.startswith("data: ") for f in frames)
    assert frames[-1] == "data: [DONE]"


def test_batched_prompts_and_n_give_indexed_choices(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL, prompt=["one two", "three four"], max_tokens=4, n=2, temperature=1.0, seed=7
    )
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    again = client.completions.create(
        model=MODEL, prompt=["one two", "three four"], max_tokens=4, n=2, temperature=1.0, seed=7
    )
    assert [c.text for c in out.choices] == [c.text for c in again.choices]  # seeded


def test_token_id_prompt_and_stop_string(client: openai.OpenAI, tiny_llama: Path) -> None:
    ids = AutoTokenizer.from_pretrained(tiny_llama).encode(PROMPT)
    full = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    text = full.choices[0].text
    assert text == _engine_greedy(tiny_llama, ids, 12)
    stop = text[3:5]
    cut = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=12, temperature=0, stop=[stop]
    )
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[: text.index(stop)]


def test_echo_with_max_tokens_zero_scores_the_prompt(
    shared_server: LiveServer, tiny_llama: Path
) -> None:
    """What lm-eval's loglikelihood needs: the prompt's token log-probabilities."""
    ids = AutoTokenizer.from_pretrained(tiny_llama).encode(PROMPT)
    body = {"prompt": ids, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0}
    resp = httpx.post(f"{shared_server.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    [choice] = resp.json()["choices"]
    lp = choice["logprobs"]
    assert len(lp["token_logprobs"]) == len(ids) and lp["token_logprobs"][0] is None
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    expected = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(lp["token_logprobs"][1:]), expected, atol=1e-4)
    assert "".join(lp["tokens"]) == choice["text"]
    assert resp.json()["usage"]["completion_tokens"] == 0
    # each top_logprobs entry holds the top-1 token, so is_greedy is decidable
    best = ref[:-1].max(-1).values
    tops = [max(t.values()) for t in lp["top_logprobs"][1:]]
    assert torch.allclose(torch.tensor(tops), best, atol=1e-4)


def test_prompt_logprobs_answer_as_vllm_shapes_them(
    shared_server: LiveServer, tiny_llama: Path
) -> None:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {id: {logprob, rank,
    decoded_token}} with the top N and the prompt's own token, matching transformers."""
    ids = AutoTokenizer.from_pretrained(tiny_llama).encode(PROMPT)
    body = {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 3, "temperature": 0}
    resp = httpx.post(f"{shared_server.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    [choice] = resp.json()["choices"]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].log_softmax(-1)
    for position, (token, entry) in enumerate(zip(ids[1:], entries[1:], strict=True)):
        row = ref[position]
        top = row.topk(3)
        assert {int(t) for t, e in entry.items() if e["rank"] <= 3} == set(top.indices.tolist())
        mine = entry[str(token)]
        assert abs(mine["logprob"] - float(row[token])) < 1e-4
        assert mine["rank"] == int((row > row[token]).sum()) + 1
    streamed = httpx.post(
        f"{shared_server.url}/v1/completions", json={**body, "stream": True}, timeout=60
    )
    assert streamed.status_code == 400 and "prompt_logprobs" in streamed.text


def test_chat_uses_the_chat_template(client: openai.OpenAI, tiny_llama: Path) -> None:
    messages = [{"role": "user", "content": "Say hi"}]
    out = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=6,
        temperature=0,  # type: ignore[arg-type]
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert out.choices[0].message.content == _engine_greedy(tiny_llama, ids, 6)
    assert out.choices[0].message.role == "assistant"
    assert out.usage is not None and out.usage.prompt_tokens == len(ids)


def test_streamed_chat_and_logprobs(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count to three"}]
    whole = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = whole.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 6
    assert all(len(item.top_logprobs) == 2 for item in content)
    assert all(item.logprob <= item.top_logprobs[0].logprob + 1e-6 for item in content)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=6,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_models_lists_the_served_model(client: openai.OpenAI) -> None:
    [model] = client.models.list().data
    assert model.id == MODEL


# vLLM 0.32's metrics (vllm/v1/metrics/loggers.py) a vLLM dashboard reads, by Prometheus type;
# spec_decode_* appear where the engine reports them (the shared server's engine does).
VLLM_METRICS = {
    "num_requests_running": "gauge", "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge", "prefix_cache_queries": "counter",
    "prefix_cache_hits": "counter", "prompt_tokens": "counter", "generation_tokens": "counter",
    "num_preemptions": "counter", "request_success": "counter",
    "request_prompt_tokens": "histogram", "request_generation_tokens": "histogram",
    "iteration_tokens_total": "histogram", "request_params_n": "histogram",
    "request_params_max_tokens": "histogram", "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "request_time_per_output_token_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram", "request_queue_time_seconds": "histogram",
    "request_inference_time_seconds": "histogram", "request_prefill_time_seconds": "histogram",
    "request_decode_time_seconds": "histogram", "cache_config_info": "gauge",
    "spec_decode_num_drafts": "counter", "spec_decode_num_accepted_tokens": "counter",
    "num_requests_waiting_by_reason": "gauge", "prompt_tokens_cached": "counter",
    "request_max_num_generation_tokens": "histogram", "request_num_preemptions": "histogram",
    "request_prefill_kv_computed_tokens": "histogram", "admission_rejections": "counter",
}  # fmt: skip


def test_metrics_use_vllm_names(shared_server: LiveServer, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{shared_server.url}/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    ours = {"model_name": MODEL, "engine": "0"}
    for name, kind in VLLM_METRICS.items():
        family = families[f"vllm:{name}"]
        assert family.type == kind, name
        # cache_config_info's labels are the cache settings and engine, admission_rejections'
        # the model and reason, as vLLM's
        labels = {"engine": "0"} if name == "cache_config_info" else ours
        if name == "admission_rejections":
            labels = {"model_name": MODEL}
        assert all(labels.items() <= sample.labels.items() for sample in family.samples), name

    def value(family: str, sample: str, **labels: str) -> float:
        want = {**ours, **labels}.items()
        found = [s.value for s in families[family].samples
                 if s.name == sample and want <= s.labels.items()]  # fmt: skip
        assert len(found) == 1, (sample, labels)
        return float(found[0])

    success = "vllm:request_success"
    assert value(success, success + "_total", finished_reason="length") >= 1.0
    assert value(success, success + "_total", finished_reason="error") == 0.0  # made at zero
    ttft = "vllm:time_to_first_token_seconds"
    assert value(ttft, ttft + "_bucket", le="0.001") >= 0
    steps = "vllm:iteration_tokens_total"
    assert value(steps, steps + "_bucket", le="16384.0") >= 2  # a prefill and decodes
    waiting = "vllm:num_requests_waiting_by_reason"
    assert value(waiting, waiting, reason="deferred") == 0.0
    preempted = "vllm:request_num_preemptions"
    assert value(preempted, preempted + "_sum") == 0  # none of these requests was preempted
    assert value(preempted, preempted + "_count") >= 1
    computed = "vllm:request_prefill_kv_computed_tokens"
    assert value(computed, computed + "_sum") > 0
    info = families["vllm:cache_config_info"].samples[0].labels
    assert {"block_size", "num_gpu_blocks", "cache_dtype", "engine"} <= set(info)
    # the process and HTTP metrics a vLLM server exposes beside its own
    process = (
        "process_cpu_seconds",
        "process_resident_memory_bytes",
        "python_gc_objects_collected",
    )
    for name in (*process, "http_requests", "http_request_duration_seconds"):
        assert name in families, name
    assert any(s.labels.get("handler") == "/v1/completions"
               for s in families["http_requests"].samples)  # fmt: skip
    stats = shared_server.state.backend.stats()
    tokens = "vllm:generation_tokens"
    assert value(tokens, tokens + "_total") == stats.generation_tokens_total
