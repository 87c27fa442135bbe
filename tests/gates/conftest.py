"""Helpers for gate tests: small real artifacts, and a tiny OpenAI-style SSE server."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from kiln.runtime.formats import artifact

Responder = Callable[[dict[str, Any]], str]

# Hermetic: lm-eval's task data is cached by `datasets`, which reads this when first imported.
os.environ.setdefault("HF_DATASETS_CACHE", tempfile.mkdtemp(prefix="kiln-test-datasets-"))


def build_artifact(
    root: Path, payload: bytes = b"weights", name: str = "demo", model_dir: Path | None = None
) -> Path:
    """Publish a real artifact; its model/ is a copy of model_dir, or one small file."""
    manifest = artifact.Manifest(
        name=name, recipe={"name": name, "quantization": {"method": "none", "weight_bits": 16}}
    )
    with artifact.assemble(root, manifest) as staging:
        if model_dir is not None:
            shutil.copytree(model_dir, staging.dir / "model")
        else:
            (staging.dir / "model").mkdir()
            (staging.dir / "model" / "w.bin").write_bytes(payload)
    assert staging.path is not None
    return staging.path


def _prompt_of(body: dict[str, Any]) -> str:
    if "messages" in body:
        return str(body["messages"][-1]["content"])
    return str(body["prompt"])


class OpenAIStub:
    """A real HTTP server on 127.0.0.1 that streams a responder's text word by word (or
    answers it whole to a request that does not stream), with no log-probabilities: a
    server like TensorRT-LLM 1.2's completions."""

    def __init__(self, responder: Responder, delay_s: float = 0.0) -> None:
        self.responder = responder
        self.delay_s = delay_s
        self.requests: list[dict[str, Any]] = []
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # keep pytest output clean
                pass

            def do_GET(self) -> None:
                if self.path != "/v1/models":
                    self.send_error(404)
                    return
                body = json.dumps({"data": [{"id": "stub-model"}]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_POST(self) -> None:
                length = int(self.headers["Content-Length"])
                body = json.loads(self.rfile.read(length))
                stub.requests.append(body)
                chat = self.path == "/v1/chat/completions"
                if self.path not in ("/v1/completions", "/v1/chat/completions"):
                    self.send_error(404)
                    return
                text = stub.responder(body)
                if text.startswith("!500"):
                    self.send_error(500, "stub failure")
                    return
                if not body.get("stream"):  # a whole answer, with no log-probabilities
                    self._whole(text, chat)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                words = text.split(" ")
                pieces = [w if i == 0 else " " + w for i, w in enumerate(words)]
                for piece in pieces:
                    time.sleep(stub.delay_s)
                    choice = {"index": 0, "finish_reason": None}
                    if chat:
                        choice["delta"] = {"content": piece}
                    else:
                        choice["text"] = piece
                    self._event({"choices": [choice]})
                last: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
                last["delta" if chat else "text"] = {} if chat else ""
                self._event({"choices": [last]})
                self._event({"choices": [], "usage": {"completion_tokens": len(pieces)}})
                self.wfile.write(b"data: [DONE]\n\n")

            def _whole(self, text: str, chat: bool) -> None:
                choice: dict[str, Any] = {"index": 0, "finish_reason": "stop"}
                if chat:
                    choice["message"] = {"role": "assistant", "content": text}
                else:
                    choice["text"] = text
                data = json.dumps({"choices": [choice]}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _event(self, data: dict[str, Any]) -> None:
                self.wfile.write(f"data: {json.dumps(data)}\n\n".encode())
                self.wfile.flush()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> OpenAIStub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(scope="module")
def noisy_artifact(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An artifact of the tiny Llama with 5% noise on every weight matrix: a candidate that
    differs from its float baseline."""
    from tests.gates.test_gate_e2e import perturbed_copy

    root = tmp_path_factory.mktemp("engine-gate")
    noisy = perturbed_copy(tiny_llama, root / "noisy", scale=0.05)
    return build_artifact(root / "arts", name="noisy", model_dir=noisy)


@pytest.fixture
def openai_stub() -> Iterator[Callable[..., OpenAIStub]]:
    """Start stubs on demand; every one started is shut down after the test."""
    started: list[OpenAIStub] = []

    def start(responder: Responder, delay_s: float = 0.0) -> OpenAIStub:
        stub = OpenAIStub(responder, delay_s).__enter__()
        started.append(stub)
        return stub

    yield start
    for stub in started:
        stub.__exit__()


# A crafted traffic file: two completions, two chats, two that ask for JSON.
TRAFFIC = [
    {
        "id": "r1",
        "endpoint": "/v1/completions",
        "request": {"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0.7},
    },
    {
        "id": "r2",
        "endpoint": "/v1/chat/completions",
        "request": {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8},
    },
    {
        "id": "r3",
        "endpoint": "/v1/chat/completions",
        "request": {"messages": [{"role": "user", "content": "Reply in JSON with a name."}]},
    },
    {
        "id": "r4",
        "endpoint": "/v1/chat/completions",
        "request": {
            "messages": [{"role": "user", "content": "Give me a user record."}],
            "response_format": {"type": "json_object"},
        },
    },
    {"id": "r5", "endpoint": "/v1/completions", "request": {"prompt": "Once upon a time"}},
    {"id": "r6", "endpoint": "/v1/completions", "request": {"prompt": "Count: one two"}},
]

BASELINE_ANSWERS = {
    "The quick brown fox": "jumps over the lazy dog",
    "Name a colour.": "Blue is a colour",
    "Reply in JSON with a name.": '{"name": "Ada"}',
    "Give me a user record.": '{"user": "ada", "id": 7}',
    "Once upon a time": "there was a small village by the sea",
    "Count: one two": "three four five",
}


def baseline_responder(body: dict[str, Any]) -> str:
    return BASELINE_ANSWERS[_prompt_of(body)]


def write_traffic(path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in TRAFFIC))
    return path


def answers_with(changes: dict[str, str]) -> Responder:
    """A responder answering like the baseline except for the changed prompts."""
    answers = {**BASELINE_ANSWERS, **changes}
    return lambda body: answers[_prompt_of(body)]
