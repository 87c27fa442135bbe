"""Bad input gets a 400 that names it, on a connection that stays open: text that is not
Unicode, and more tokens than the context holds."""

from __future__ import annotations

import http.client
import json
from typing import Any

import httpx
import pytest

from tests.serve.conftest import MODEL, LiveServer

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _keep_alive_pair(server: LiveServer, path: str, raw_body: str) -> dict[str, Any]:
    """POST `raw_body` (JSON text, sent as is), then a good request on the same connection;
    the first answer's error, after checking the connection carried both."""
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        headers = {"Content-Type": "application/json"}
        conn.request("POST", path, body=raw_body.encode(), headers=headers)
        first = conn.getresponse()
        payload = json.loads(first.read())
        assert first.status == 400, payload
        assert (first.getheader("connection") or "").lower() != "close"
        sock = conn.sock
        good = json.dumps({"model": MODEL, "prompt": "hello", "max_tokens": 2})
        conn.request("POST", COMPLETIONS, body=good.encode(), headers=headers)
        second = conn.getresponse()
        second.read()
        assert second.status == 200 and conn.sock is sock and sock is not None
        return dict(payload["error"])
    finally:
        conn.close()


@pytest.mark.parametrize(
    ("path", "raw_body", "where"),
    [
        (COMPLETIONS, r'{"prompt": "ab\ud800c", "max_tokens": 2}', "prompt"),
        (COMPLETIONS, r'{"prompt": ["ok", "\udfff"], "max_tokens": 2}', "prompt[1]"),
        (CHAT, r'{"messages": [{"role": "user", "content": "hi \ud800"}]}', "messages[0].content"),
        (
            CHAT,
            r'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud83d"}]}]}',
            "messages[0].content[0].text",
        ),
    ],
)
def test_a_lone_surrogate_is_400_naming_the_field_and_keeps_the_connection(
    shared_server: LiveServer, path: str, raw_body: str, where: str
) -> None:
    error = _keep_alive_pair(shared_server, path, raw_body)
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert f"{where}: character" in error["message"]
    assert "lone UTF-16 surrogate" in error["message"]
    assert error["param"] == where.split("[")[0].split(".")[0]


def test_a_whole_surrogate_pair_is_text(shared_server: LiveServer) -> None:
    body = r'{"prompt": "smile \ud83d\ude00", "max_tokens": 2}'
    resp = httpx.post(
        f"{shared_server.url}{COMPLETIONS}",
        content=body,
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text


@pytest.mark.parametrize("max_tokens", [129, 9000, 10**30])
def test_max_tokens_beyond_the_context_is_400(shared_server: LiveServer, max_tokens: int) -> None:
    prompt = [5, 6, 7, 8]  # four tokens of a 128-token context: room for 124
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens})
    error = _keep_alive_pair(shared_server, COMPLETIONS, body)
    assert error["param"] == "max_tokens"
    assert "context is 128 tokens" in error["message"] and "at most 124" in error["message"]


def test_one_token_past_the_room_left_by_the_prompt_is_400(shared_server: LiveServer) -> None:
    body = {"prompt": [5, 6, 7, 8], "max_tokens": 125}
    resp = httpx.post(f"{shared_server.url}{COMPLETIONS}", json=body, timeout=60)
    assert resp.status_code == 400 and "at most 124" in resp.json()["error"]["message"]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_max_tokens_beyond_the_context_is_400_naming_the_field(
    shared_server: LiveServer, field: str
) -> None:
    body = json.dumps({"messages": [{"role": "user", "content": "hi"}], field: 9000})
    error = _keep_alive_pair(shared_server, CHAT, body)
    assert error["param"] == field and "context is 128 tokens" in error["message"]


@pytest.mark.parametrize("role", ["system", "developer", "user", "tool"])
def test_null_content_where_the_role_needs_text_is_400_naming_the_message(
    shared_server: LiveServer, role: str
) -> None:
    """OpenAI and vLLM refuse it too: such a message has nothing to say."""
    messages = [{"role": "user", "content": "hi"}, {"role": role, "content": None}]
    error = _keep_alive_pair(shared_server, CHAT, json.dumps({"messages": messages}))
    assert error["type"] == "invalid_request_error" and error["code"] == 400
    assert error["param"] == "messages[1].content"
    assert f"messages[1].content is null: a {role} message needs content" in error["message"]


def test_an_assistant_turn_may_have_null_content(shared_server: LiveServer) -> None:
    """As in OpenAI's and vLLM's schemas; the turn is rendered empty, as vLLM renders it."""
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None},
        {"role": "user", "content": "and now?"},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2}
    resp = httpx.post(f"{shared_server.url}{CHAT}", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["role"] == "assistant"


CALL = {"name": "f", "arguments": "{}"}


@pytest.mark.parametrize(
    ("field", "value"),
    [("tool_calls", [{"id": "c1", "type": "function", "function": CALL}]), ("function_call", CALL)],
)
def test_a_tool_call_in_the_chat_is_400_naming_it_not_dropped(
    shared_server: LiveServer, field: str, value: Any
) -> None:
    """The null content OpenAI allows beside a tool call would leave an empty turn: the
    call would vanish from the chat the model is shown, so the request is refused."""
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, field: value},
    ]
    error = _keep_alive_pair(shared_server, CHAT, json.dumps({"messages": messages}))
    assert error["param"] == f"messages[1].{field}"
    assert "tool calls (function calling) are not supported" in error["message"]


@pytest.mark.parametrize(
    ("messages", "where"),
    [
        ([{"role": "user", "content": [{"type": "text", "text": None}]}],
         "messages[0].content[0].text (as list[TextPart])"),
        ([None], "messages[0]:"),
        ([{"role": "user", "content": 7}], "messages[0].content (as str)"),
    ],
)  # fmt: skip
def test_a_wrongly_typed_message_is_400_naming_the_field_as_clients_write_it(
    shared_server: LiveServer, messages: list[Any], where: str
) -> None:
    error = _keep_alive_pair(shared_server, CHAT, json.dumps({"messages": messages}))
    assert error["code"] == 400 and error["param"] == "messages"
    assert where in error["message"], error["message"]
