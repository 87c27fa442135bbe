"""A request is bounded before it costs the server anything: a prompt too long in bytes for
the model's context is refused before it is tokenised, a body over the size limit is 413, a
body that stalls is 408, and an empty API key cannot open a server that asked for keys."""

from __future__ import annotations

import socket

import httpx
import pytest

from kiln.runtime.base.errors import UsageError
from kiln.runtime.server import ServerConfig
from tests.serve.conftest import MODEL, ServerFactory


def test_a_prompt_longer_in_bytes_than_the_context_is_refused_before_tokenising(
    start_server: ServerFactory,
) -> None:
    server = start_server()
    tokens = server.state.backend.tokens
    huge = "x" * (128 * tokens.max_token_bytes + 1)  # the tiny engine's context is 128
    resp = httpx.post(f"{server.url}/v1/completions", json={"prompt": huge, "max_tokens": 1})
    assert resp.status_code == 400
    error = resp.json()["error"]
    # The byte bound says so; a tokenised prompt would be refused for its token count.
    assert error["param"] == "prompt"
    assert f"at most {tokens.max_token_bytes} bytes a token" in error["message"]


def test_chat_messages_longer_in_bytes_than_the_context_are_refused(
    start_server: ServerFactory,
) -> None:
    server = start_server()
    huge = "x" * (128 * server.state.backend.tokens.max_token_bytes + 1)
    body = {"messages": [{"role": "user", "content": huge}], "max_tokens": 1}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"


def test_a_body_over_the_limit_is_413_naming_the_limit(start_server: ServerFactory) -> None:
    server = start_server(config={"max_request_bytes": 1000})
    body = {"prompt": "y" * 2000, "max_tokens": 1}
    resp = httpx.post(f"{server.url}/v1/completions", json=body)
    assert resp.status_code == 413
    assert "--max-request-bytes" in resp.json()["error"]["message"]


def test_a_chunked_body_over_the_limit_is_413(start_server: ServerFactory) -> None:
    server = start_server(config={"max_request_bytes": 1000})

    def chunks() -> object:
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"z" * 100
        yield b'", "max_tokens": 1}'

    resp = httpx.post(
        f"{server.url}/v1/completions",
        content=chunks(),
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 413


def test_a_stalled_body_is_408(start_server: ServerFactory) -> None:
    server = start_server(config={"body_timeout_s": 0.5})
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"prompt": '
        )  # and nothing more
        answer = sock.recv(4096).decode()
    assert answer.startswith("HTTP/1.1 408")
    assert "--body-timeout" in answer


@pytest.mark.parametrize("keys", [("",), ("   ",), ("good", "")])
def test_an_empty_api_key_is_refused_at_start(keys: tuple[str, ...]) -> None:
    with pytest.raises(UsageError, match="empty API key"):
        ServerConfig.keys_from(keys)
    with pytest.raises(UsageError, match="empty key"):
        ServerConfig(MODEL, api_keys=keys)


def test_an_empty_api_key_in_the_environment_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_API_KEY", "")
    with pytest.raises(UsageError, match=r"\$KILN_API_KEY"):
        ServerConfig.keys_from(None)
    monkeypatch.delenv("KILN_API_KEY")
    assert ServerConfig.keys_from(None) == ()
