"""AsyncEngine: the engine's step loop on a background thread, streamed to asyncio callers.

Only the background thread touches the engine's state; callers hand it requests and aborts
through a thread-safe inbox that it drains before every step, so an abort frees the
request's blocks before the next forward. Each request's deltas come back through its own
asyncio.Queue on the caller's event loop. torch releases the GIL inside its kernels, so the
event loop stays responsive while a step runs. An HTTP server calls `generate` per request
and `abort` when a client disconnects (leaving the async generator early aborts too).
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator
from typing import Any, Unpack

from kiln.runtime.base.errors import UsageError
from kiln.runtime.engine.core import Engine, Prompt, RequestOptions
from kiln.runtime.engine.outputs import EngineStats, RequestOutput, delta_output
from kiln.runtime.engine.sampling import SamplingParams
from kiln.runtime.engine.sequence import Request

Delivery = RequestOutput | BaseException
Stream = tuple[asyncio.AbstractEventLoop, "asyncio.Queue[Delivery]"]


class AsyncEngine:
    """Serve an Engine to many concurrent asyncio consumers."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, Stream] = {}
        self._lock = threading.Lock()
        self._start_lock = threading.Lock()  # one step loop, however many loops call start
        self._stopping = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the background step loop (idempotent, and safe from several threads: the
        first caller starts it; a second thread stepping the same engine would corrupt it)."""
        with self._start_lock:
            if self._thread is None or not self._thread.is_alive():
                self._stopping = False
                self._thread = threading.Thread(target=self._loop, name="kiln-engine", daemon=True)
                self._thread.start()

    def shutdown(self) -> None:
        """Stop the loop after its current step; unfinished requests stay unfinished."""
        with self._start_lock:
            self._stopping = True
            self._wake.set()
            if self._thread is not None:
                self._thread.join()
                self._thread = None

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        **options: Unpack[RequestOptions],
    ) -> AsyncIterator[RequestOutput]:
        """Yield the request's deltas until one says `finished`; raises UsageError at once
        for a bad prompt or parameters."""
        request = self.engine.make_request(prompt, params, **options)
        rid = request.request_id
        stream: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        with self._lock:
            if rid in self._streams:
                raise UsageError(f"request id {rid!r} is already in use")
            self._streams[rid] = (asyncio.get_running_loop(), stream)
        self.start()
        self._send("add", request)
        finished = False
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(rid)
            with self._lock:
                self._streams.pop(rid, None)

    def abort(self, request_id: str) -> None:
        """Abort a request; its blocks are freed before the engine's next step."""
        self._send("abort", request_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def _send(self, command: str, payload: Any) -> None:
        self._inbox.put((command, payload))
        self._wake.set()

    def _deliver(self, request_id: str, item: Delivery) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, Delivery]]) -> None:
        """Hand each item to its request's stream: one wake-up per event loop for the lot.

        A step's deltas go together: a wake-up each would switch the core between this
        thread and the event loop's once per request (32 times a step at concurrency 32)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[Stream, Delivery]]] = {}
        with self._lock:
            for request_id, item in items:
                stream = self._streams.get(request_id)
                if stream is not None:
                    batches.setdefault(stream[0], []).append((stream, item))
        for loop, batch in batches.items():
            loop.call_soon_threadsafe(_put_all, batch)

    def _drain(self) -> None:
        while True:
            try:
                command, payload = self._inbox.get_nowait()
            except queue.Empty:
                return
            if command == "add":
                request: Request = payload
                try:
                    self.engine.add(request)
                except UsageError as exc:
                    self._deliver(request.request_id, exc)
            elif command == "abort":
                request_or_none = self.engine.requests.get(payload)
                if request_or_none is not None and self.engine.abort(payload):
                    self._deliver(payload, delta_output(request_or_none))

    def _loop(self) -> None:
        while not self._stopping:
            self._drain()
            if not self.engine.has_unfinished_requests():
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a failed step fails every stream, not the thread
                failed = list(self.engine.requests)
                for rid in failed:
                    self.engine.abort(rid)
                self._deliver_all([(rid, exc) for rid in failed])
                continue
            self._deliver_all([(output.request_id, output) for output in outputs])


def _put_all(batch: list[tuple[Stream, Delivery]]) -> None:
    for (_, target), item in batch:
        target.put_nowait(item)
