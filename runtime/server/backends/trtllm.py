"""`--backend trtllm`: serve a TensorRT-LLM engine through its LLM API, behind the same
routes as the native engine.

TensorRT-LLM is imported lazily (it exists only on NVIDIA machines). Engines from
`trtllm-build` load with `tensorrt_llm._tensorrt_engine.LLM` on TensorRT-LLM 1.x, where
plain `tensorrt_llm.LLM` is the PyTorch backend; older releases have only the latter.
Streaming uses `generate_async(..., streaming=True)`, whose result is async-iterable and
whose completion outputs carry `text_diff` / `token_ids_diff`; `abort()` cancels it.
Whether the engine fits this GPU is checked before this module is used (the CLI calls
compiler.trtllm.build.check_engine_compatible); runtime imports nothing of ours.
Engine gauges (KV usage, queue) are not read from TensorRT-LLM here: `stats` reports the
requests this adapter has in flight and the token counters it has seen.
"""

from __future__ import annotations

import importlib
import itertools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from kiln.runtime.base.errors import UsageError
from kiln.runtime.engine.outputs import EngineStats, RequestOutput
from kiln.runtime.engine.sampling import SamplingParams
from kiln.runtime.server.tokenizers import TokenizerPool


def trtllm_available() -> bool:
    """Whether `tensorrt_llm` imports here."""
    try:
        importlib.import_module("tensorrt_llm")
    except Exception:  # ImportError, or a CUDA library missing underneath it
        return False
    return True


def _llm_class() -> Any:
    try:
        return importlib.import_module("tensorrt_llm._tensorrt_engine").LLM
    except (ImportError, AttributeError):
        return importlib.import_module("tensorrt_llm").LLM


class TrtllmBackend:
    """TensorRT-LLM's LLM API on a built engine directory."""

    name = "trtllm"

    def __init__(self, engine_dir: str | Path, tokenizer_dir: str | Path, max_model_len: int,
                 **llm_options: Any) -> None:  # fmt: skip
        from transformers import AutoTokenizer

        self.engine_dir = Path(engine_dir)
        self.tokens = TokenizerPool(AutoTokenizer.from_pretrained(str(tokenizer_dir)))
        self.max_model_len = max_model_len
        self._options = llm_options
        self._llm: Any = None
        self._running: dict[str, Any] = {}
        self._ids = itertools.count()
        self._prompt_tokens = self._generation_tokens = 0

    def start(self) -> None:
        if self._llm is None:
            llm_class = _llm_class()
            self._llm = llm_class(model=str(self.engine_dir), tokenizer=self.tokens.tokenizer,
                                  **self._options)  # fmt: skip

    def shutdown(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def validate(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> None:
        if not prompt_ids:
            raise UsageError(f"request {request_id}: the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise UsageError(
                f"request {request_id}: prompt has {len(prompt_ids)} tokens; the engine's "
                f"limit is {self.max_model_len} including output; shorten the prompt"
            )

    def _params(self, params: SamplingParams) -> Any:
        tllm = importlib.import_module("tensorrt_llm")
        return tllm.SamplingParams(
            max_tokens=params.max_tokens,
            temperature=params.temperature,
            top_k=params.top_k or None,
            top_p=params.top_p,
            seed=params.seed,
            stop=params.stop or None,
            stop_token_ids=params.stop_token_ids or None,
            ignore_eos=params.ignore_eos,
            include_stop_str_in_output=params.include_stop_str_in_output,
            logprobs=params.logprobs,
        )

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        if self._llm is None:
            raise UsageError("the TensorRT-LLM backend is not started")
        result = self._llm.generate_async(prompt_ids, self._params(params), streaming=True)
        self._running[request_id] = result
        self._prompt_tokens += len(prompt_ids)
        finished = False
        try:
            async for out in result:
                completion = out.outputs[0]
                tokens = list(getattr(completion, "token_ids_diff", None) or [])
                self._generation_tokens += len(tokens)
                finished = bool(out.finished)
                yield RequestOutput(
                    request_id=request_id,
                    prompt_token_ids=prompt_ids,
                    text=str(getattr(completion, "text_diff", "") or ""),
                    token_ids=tokens,
                    finished=finished,
                    finish_reason=completion.finish_reason if finished else None,
                    stop_reason=getattr(completion, "stop_reason", None),
                )
        finally:
            self._running.pop(request_id, None)
            if not finished:
                result.abort()

    def abort(self, request_id: str) -> None:
        result = self._running.pop(request_id, None)
        if result is not None:
            result.abort()

    def stats(self) -> EngineStats:
        return EngineStats(
            num_requests_running=len(self._running),
            num_requests_waiting=0,
            kv_cache_usage=0.0,
            num_blocks=0,
            prefix_cache_queries=0,
            prefix_cache_hits=0,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            num_preemptions=0,
            num_steps=0,
            busy_seconds=0.0,
        )
