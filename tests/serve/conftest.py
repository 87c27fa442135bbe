"""Helpers for `kiln serve` tests: the real app on the tiny model, on a free port of 127.0.0.1."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
import uvicorn

from kiln.runtime import Engine
from kiln.runtime.server import NativeBackend, ServerConfig, create_app

MODEL = "tiny-llama"


@pytest.fixture(autouse=True)
def _one_thread() -> None:
    # Two shared cores: one torch thread keeps tests fast and results independent of load.
    torch.set_num_threads(1)


def free_socket() -> socket.socket:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def wait_ready(url: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{url} did not become ready in {timeout_s} s")


class LiveServer:
    """uvicorn serving an app in a thread; `url` is its base URL."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.sock = free_socket()
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )

    @property
    def state(self) -> Any:
        return self.app.state.kiln

    def start(self) -> LiveServer:
        self.thread.start()
        wait_ready(self.url)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def tiny_engine(model_dir: Path, **options: Any) -> Engine:
    options = {"max_num_seqs": 4, "max_model_len": 128, "num_threads": 1, **options}
    return Engine.from_pretrained(model_dir, **options)


ServerFactory = Callable[..., LiveServer]


@pytest.fixture
def start_server(tiny_llama: Path) -> Iterator[ServerFactory]:
    """Start servers on the tiny model (engine options and create_app arguments as keywords);
    every one is stopped at the end of the test."""
    started: list[LiveServer] = []

    def start(
        engine: Engine | None = None,
        config: dict[str, Any] | None = None,
        **app_options: Any,
    ) -> LiveServer:
        engine = engine or tiny_engine(tiny_llama)
        settings = {"model_name": MODEL, "max_running": engine.config.max_num_seqs}
        server_config = ServerConfig(**{**settings, **(config or {})})
        server = LiveServer(create_app(NativeBackend(engine), server_config, **app_options))
        started.append(server.start())
        return server

    yield start
    for server in started:
        server.stop()


@pytest.fixture(scope="module")
def shared_server(tiny_llama: Path) -> Iterator[LiveServer]:
    """One server for the read-only API tests of a module."""
    engine = tiny_engine(tiny_llama)
    config = ServerConfig(MODEL, max_running=engine.config.max_num_seqs)
    server = LiveServer(create_app(NativeBackend(engine), config)).start()
    yield server
    server.stop()
