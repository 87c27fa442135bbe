"""A request that is slow to tokenise holds neither the event loop nor other requests."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx

from kiln.runtime.server import NativeBackend, ServerConfig, create_app
from tests.serve.conftest import MODEL, LiveServer, tiny_engine

# Generous: these bound how long a broken server may hang the test, not how fast it runs.
WAIT_S = 60


class HeldTokenizer:
    """The model's own tokenizer, except that encoding `HELD` waits until released: a prompt
    that takes as long to tokenise as the test wants."""

    HELD = "a prompt that takes a long time to tokenise"

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.entered = threading.Event()
        self.release = threading.Event()
        self.holding = False

    def __call__(self, text: str, **kwargs: Any) -> Any:
        if text == self.HELD:
            self.holding = True
            self.entered.set()
            released = self.release.wait(WAIT_S)
            self.holding = False
            assert released, "nobody released the tokenizer"
        return self._tokenizer(text, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)


def test_health_and_other_requests_answer_while_a_prompt_tokenises(tiny_llama: Path) -> None:
    backend = NativeBackend(tiny_engine(tiny_llama))
    held = HeldTokenizer(backend.tokenizer)
    backend.tokenizer = held
    server = LiveServer(create_app(backend, ServerConfig(MODEL, max_running=4))).start()
    slow: dict[str, Any] = {}

    def send_slow() -> None:
        body = {"prompt": HeldTokenizer.HELD, "max_tokens": 2}
        slow["response"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=WAIT_S)

    sender = threading.Thread(target=send_slow)
    try:
        sender.start()
        assert held.entered.wait(WAIT_S)
        # The prompt is still being tokenised: the loop answers meanwhile.
        assert httpx.get(f"{server.url}/health", timeout=WAIT_S).status_code == 200
        assert held.holding
        other = {"prompt": [5, 6, 7], "max_tokens": 2}
        resp = httpx.post(f"{server.url}/v1/completions", json=other, timeout=WAIT_S)
        assert resp.status_code == 200 and held.holding
    finally:
        held.release.set()
        sender.join(WAIT_S)
        server.stop()
    assert slow["response"].status_code == 200
