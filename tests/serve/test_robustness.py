"""Errors in OpenAI's shape, API keys, 429 under overload, and a client that leaves early
freeing its KV blocks (streaming and not)."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kiln.runtime.server import ServerConfig
from tests.serve.conftest import MODEL, LiveServer, ServerFactory, tiny_engine


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    return dict(error)


def test_malformed_json_is_400(shared_server: LiveServer) -> None:
    resp = httpx.post(
        f"{shared_server.url}/v1/completions",
        content=b'{"prompt": "x", ',
        headers={"content-type": "application/json"},
    )
    assert "malformed JSON" in _error(resp, 400)["message"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 3.0),
        ("top_p", 0.0),
        ("max_tokens", -1),
        ("logprobs", 50),
        ("n", 100),
        ("top_k", -5),
        ("prompt", [-1, 2]),
    ],
)
def test_out_of_range_parameters_are_400_naming_the_field(
    shared_server: LiveServer, field: str, value: Any
) -> None:
    body = {"model": MODEL, "prompt": "hello", field: value}
    error = _error(httpx.post(f"{shared_server.url}/v1/completions", json=body), 400)
    assert error["param"] == field and error["type"] == "invalid_request_error"


def test_unsupported_options_are_refused_not_ignored(shared_server: LiveServer) -> None:
    body = {"prompt": "hello", "best_of": 3}
    error = _error(httpx.post(f"{shared_server.url}/v1/completions", json=body), 400)
    assert "best_of" in error["message"] and error["param"] == "best_of"
    chat = {"messages": [{"role": "user", "content": "hi"}],
            "response_format": {"type": "json_object"}}  # fmt: skip
    error = _error(httpx.post(f"{shared_server.url}/v1/chat/completions", json=chat), 400)
    assert "constrained decoding" in error["message"]
    body = {"prompt": "hello", "max_tokens": 0}
    assert (
        "echo"
        in _error(httpx.post(f"{shared_server.url}/v1/completions", json=body), 400)["message"]
    )


def test_prompt_longer_than_the_context_says_the_limit(shared_server: LiveServer) -> None:
    body = {"prompt": list(range(1, 200)), "max_tokens": 4}
    error = _error(httpx.post(f"{shared_server.url}/v1/completions", json=body), 400)
    assert "199 tokens" in error["message"] and "limit is 128" in error["message"]
    chat = {"messages": [{"role": "user", "content": "word " * 300}]}
    error = _error(httpx.post(f"{shared_server.url}/v1/chat/completions", json=chat), 400)
    assert "limit is 128" in error["message"]


def test_unknown_model_and_route(shared_server: LiveServer) -> None:
    body = {"model": "gpt-4", "prompt": "x"}
    error = _error(httpx.post(f"{shared_server.url}/v1/completions", json=body), 404)
    assert error["type"] == "model_not_found" and MODEL in error["message"]
    _error(httpx.get(f"{shared_server.url}/v1/nothing"), 404)


def test_api_keys_guard_v1_but_not_health(
    start_server: ServerFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KILN_API_KEY", "k1, k2")
    keys = ServerConfig.keys_from(())
    assert keys == ("k1", "k2")
    server = start_server(config={"api_keys": keys})
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    url = f"{server.url}/v1/completions"
    assert _error(httpx.post(url, json=body), 401)["type"] == "authentication_error"
    _error(httpx.post(url, json=body, headers={"Authorization": "Bearer nope"}), 401)
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer k2"}).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="bad").models.list()
    assert openai.OpenAI(base_url=f"{server.url}/v1", api_key="k1").models.list().data


def test_with_api_keys_the_schema_needs_a_key_and_the_doc_pages_are_closed(
    start_server: ServerFactory,
) -> None:
    server = start_server(config={"api_keys": ("k1",)})
    for page in ("/docs", "/redoc"):
        assert httpx.get(f"{server.url}{page}").status_code == 404
    schema = f"{server.url}/openapi.json"
    assert _error(httpx.get(schema), 401)["type"] == "authentication_error"
    resp = httpx.get(schema, headers={"Authorization": "Bearer k1"})
    assert resp.status_code == 200 and "/v1/completions" in resp.json()["paths"]


def test_without_api_keys_the_schema_and_doc_pages_are_open(shared_server: LiveServer) -> None:
    for page in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{shared_server.url}{page}").status_code == 200


def test_models_names_the_artifact_without_its_host_path(
    start_server: ServerFactory, tiny_llama: Path
) -> None:
    server = start_server(config={"model_root": str(tiny_llama)})
    resp = httpx.get(f"{server.url}/v1/models")
    [card] = resp.json()["data"]
    assert card["root"] == tiny_llama.name
    assert str(tiny_llama.parent) not in resp.text


def test_overload_answers_429_with_retry_after(
    start_server: ServerFactory, tiny_llama: Path
) -> None:
    engine = tiny_engine(tiny_llama, max_num_seqs=1, max_model_len=512)
    server = start_server(engine, {"max_waiting": 1})
    url = f"{server.url}/v1/completions"
    long = {"prompt": "a b c", "max_tokens": 400, "ignore_eos": True, "stream": True}
    # Response headers come back once a request is admitted: one runs, one waits.
    with (
        httpx.Client(timeout=60) as a,
        httpx.Client(timeout=60) as b,
        a.stream("POST", url, json=long),
        b.stream("POST", url, json=long),
    ):
        resp = httpx.post(url, json={"prompt": "x", "max_tokens": 2})
        error = _error(resp, 429)
        assert resp.headers["Retry-After"] == "1"
        assert "max_num_seqs 1 + max_waiting 1" in error["message"]
        assert error["type"] == "rate_limit_exceeded"
    rejected = server.state.metrics.admission_rejections["max_num_queued_reqs"]
    assert rejected._value.get() == 1  # vLLM's vllm:admission_rejections{reason=...}
    _wait_idle(server)
    assert httpx.post(url, json={"prompt": "x", "max_tokens": 2}).status_code == 200


def _wait_idle(server: LiveServer, timeout_s: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = server.state.backend.stats()
        if (
            stats.num_requests_running == 0
            and stats.num_requests_waiting == 0
            and stats.kv_cache_usage == 0.0
            and server.state.in_flight == 0
        ):
            return stats
        time.sleep(0.02)
    raise AssertionError(f"engine still busy: {server.state.backend.stats()}")


def test_streaming_disconnect_aborts_and_frees_blocks(
    start_server: ServerFactory, tiny_llama: Path
) -> None:
    server = start_server(tiny_engine(tiny_llama, max_model_len=512))
    body = {"prompt": "a b c", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=60) as resp:
        lines = resp.iter_lines()
        for _ in range(3):
            next(lines)
        assert server.state.backend.stats().kv_cache_usage > 0
    stats = _wait_idle(server)
    assert stats.generation_tokens_total < 300  # aborted, not run to the end


@pytest.fixture
def long_context_llama(tiny_llama: Path, tmp_path: Path) -> Path:
    """The tiny model with room for 65,536 positions (its rotary tables extend to them)."""
    model = shutil.copytree(tiny_llama, tmp_path / "long-context")
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = LONG_CONTEXT
    (model / "config.json").write_text(json.dumps(config))
    return model


LONG_CONTEXT = 65536


def test_non_streaming_disconnect_aborts_and_frees_blocks(
    start_server: ServerFactory, long_context_llama: Path
) -> None:
    # 65,000 tokens take tens of seconds at any speed a Python step loop reaches (one step
    # per token), so only the abort can end this request before the test looks.
    engine = tiny_engine(
        long_context_llama, max_num_seqs=1, max_model_len=LONG_CONTEXT, num_blocks=4200
    )
    server = start_server(engine)
    body = {"prompt": "a b c", "max_tokens": 65000, "ignore_eos": True}
    began = server.state.backend.stats().generation_tokens_total
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3))
    stats = _wait_idle(server)
    assert stats.generation_tokens_total - began < 65000  # aborted, not run to the end


def test_health_and_requests_are_503_while_draining(start_server: ServerFactory) -> None:
    server = start_server()
    server.state.draining = True
    try:
        assert _error(httpx.get(f"{server.url}/health"), 503)["message"] == "not ready: draining"
        resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"})
        assert _error(resp, 503)["type"] == "service_unavailable"
        assert "Retry-After" in resp.headers
    finally:
        server.state.draining = False


def test_a_stream_whose_client_left_before_the_headers_still_releases_its_slot() -> None:
    import asyncio

    from kiln.runtime.server.routes import _Once, _ReleasingStream

    released: list[int] = []
    started: list[bool] = []

    async def body() -> Any:
        started.append(True)
        yield "data: never\n\n"

    async def gone(_message: Any) -> None:
        raise OSError("client disconnected")

    async def receive() -> Any:
        return {"type": "http.disconnect"}

    response = _ReleasingStream(body(), _Once(lambda: released.append(1)))
    scope = {"type": "http", "asgi": {"spec_version": "2.4"}}
    with pytest.raises(Exception):  # noqa: B017 - Starlette reports the disconnect its own way
        asyncio.run(response(scope, receive, gone))
    assert released == [1] and not started
