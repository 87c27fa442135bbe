"""What the HTTP layer serves from: a backend turns token ids and SamplingParams into a
stream of RequestOutput deltas.

`NativeBackend` is kiln's own engine (runtime.Engine behind an AsyncEngine thread);
`TrtllmBackend` (trtllm.py) adapts TensorRT-LLM's LLM API to the same surface, so routes,
metrics, recording and mirroring do not care which one runs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Protocol

from kiln.runtime.engine.outputs import EngineStats, RequestOutput
from kiln.runtime.engine.sampling import SamplingParams
from kiln.runtime.server.tokenizers import TokenizerPool


class Backend(Protocol):
    """The serving surface the HTTP layer needs."""

    name: str  # "native" or "trtllm"
    tokens: TokenizerPool  # the model's tokenizer, lent to one request at a time
    max_model_len: int

    def start(self) -> None: ...

    def shutdown(self) -> None: ...

    def validate(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> None:
        """Raise UsageError now for a request the engine would refuse."""
        ...

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...

    def stats(self) -> EngineStats: ...


class NativeBackend:
    """kiln's runtime engine, stepped on its own thread by AsyncEngine.

    Requests are tokenised on the server's worker threads with copies of the engine's
    tokenizer (tokenizers.py), so a long prompt holds neither the event loop, nor the engine
    thread's detokenizer, nor another request's tokenisation."""

    name = "native"

    def __init__(self, engine: Any) -> None:
        from kiln.runtime.engine.async_engine import AsyncEngine

        self.engine = engine
        self.async_engine = AsyncEngine(engine)
        self.tokens = TokenizerPool(engine.tokenizer)
        self.max_model_len = int(engine.max_model_len)

    def start(self) -> None:
        self.async_engine.start()

    def shutdown(self) -> None:
        self.async_engine.shutdown()

    def validate(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> None:
        # make_request checks everything add() would (length, vocab, KV capacity) and has no
        # side effect on the engine.
        self.engine.make_request(prompt_ids, params, request_id=request_id)

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        return self.async_engine.generate(prompt_ids, params, request_id=request_id)

    def abort(self, request_id: str) -> None:
        self.async_engine.abort(request_id)

    def stats(self) -> EngineStats:
        return self.engine.stats()
