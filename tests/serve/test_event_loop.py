"""A request that is slow to tokenise holds neither the event loop nor other requests."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from kiln.runtime.server import NativeBackend, ServerConfig, create_app
from kiln.runtime.server.tokenizers import TokenizerPool
from tests.serve.conftest import MODEL, LiveServer, tiny_engine

# Generous: these bound how long a broken server may hang the test, not how fast it runs.
WAIT_S = 60


class HeldTokenizer:
    """The model's own tokenizer, except that encoding `HELD` waits until released: a prompt
    that takes as long to tokenise as the test wants."""

    HELD = "a prompt that takes a long time to tokenise"

    def __init__(self, tokenizer: Any, twin: HeldTokenizer | None = None) -> None:
        """`twin`: share its events, as a second copy of the same held tokenizer."""
        self._tokenizer = tokenizer
        self.entered = twin.entered if twin else threading.Event()
        self.release = twin.release if twin else threading.Event()
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


@contextmanager
def prompt_held(backend: NativeBackend, held: HeldTokenizer) -> Iterator[LiveServer]:
    """A live server over `backend` with one request tokenising `HELD` until the block ends;
    that request still succeeds after it is released."""
    server = LiveServer(create_app(backend, ServerConfig(MODEL, max_running=4))).start()
    slow: dict[str, Any] = {}

    def send_slow() -> None:
        body = {"prompt": HeldTokenizer.HELD, "max_tokens": 2}
        slow["response"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=WAIT_S)

    sender = threading.Thread(target=send_slow)
    try:
        sender.start()
        assert held.entered.wait(WAIT_S)
        yield server
    finally:
        held.release.set()
        sender.join(WAIT_S)
        server.stop()
    assert slow["response"].status_code == 200


def test_health_and_other_requests_answer_while_a_prompt_tokenises(tiny_llama: Path) -> None:
    backend = NativeBackend(tiny_engine(tiny_llama))
    held = HeldTokenizer(backend.tokens.tokenizer)
    backend.tokens = TokenizerPool(backend.tokens.tokenizer, copies=[held])
    with prompt_held(backend, held) as server:
        # The prompt is still being tokenised: the loop answers meanwhile.
        assert httpx.get(f"{server.url}/health", timeout=WAIT_S).status_code == 200
        assert held.holding
        other = {"prompt": [5, 6, 7], "max_tokens": 2}
        resp = httpx.post(f"{server.url}/v1/completions", json=other, timeout=WAIT_S)
        assert resp.status_code == 200 and held.holding


def test_another_prompt_tokenises_while_one_is_held(tiny_llama: Path) -> None:
    backend = NativeBackend(tiny_engine(tiny_llama))
    original = backend.tokens.tokenizer
    held = HeldTokenizer(original)
    twin = HeldTokenizer(copy.deepcopy(original), twin=held)
    backend.tokens = TokenizerPool(original, copies=[held, twin])
    with prompt_held(backend, held) as server:
        other = {"prompt": "a prompt of text, tokenised meanwhile", "max_tokens": 2}
        resp = httpx.post(f"{server.url}/v1/completions", json=other, timeout=WAIT_S)
        assert resp.status_code == 200 and (held.holding or twin.holding)
