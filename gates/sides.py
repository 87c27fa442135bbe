"""The two sides a gate compares: what a side spec names, and the shadow `Side`s that answer.

A side spec is one of
- a kiln artifact directory (has `manifest.json`): evaluated through kiln's runtime;
- a model source: a local Hugging Face checkpoint directory (the float baseline), or any
  spec a registered resolver turns into one (the compiler registers `builtin:` and GGUF);
- an http(s) URL of an OpenAI-compatible endpoint (`/v1/completions`, `/v1/chat/completions`).

`HttpSide` streams (SSE) to measure TTFT and TPOT as `vllm bench serve` defines them:
TTFT = first content chunk - request sent; TPOT = (last chunk - first) / (tokens - 1).
`EngineSide` runs requests through `runtime.Engine` one at a time, so the per-request
timings are the engine's own, not a queue's.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from gates.shadow import SideResponse
from runtime.artifact import MANIFEST, content_digest, file_digests, load_manifest
from runtime.errors import UsageError
from runtime.traffic import TrafficRecord

_SOURCE_RESOLVERS: list[Callable[[str], Path | None]] = []


def register_source_resolver(resolver: Callable[[str], Path | None]) -> None:
    """Let a caller (the compiler) turn specs like `builtin:NAME` into a local HF directory.

    A resolver returns None for specs it does not handle.
    """
    _SOURCE_RESOLVERS.append(resolver)


@dataclass(slots=True)
class SideSpec:
    """A resolved side: what it is, where it is, and its identity for the registry."""

    spec: str
    kind: str  # "artifact", "source" or "http"
    name: str
    digest: str  # artifact digest, source content digest, or the URL
    path: Path | None = None
    url: str | None = None
    weight_bits: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "kind": self.kind,
            "name": self.name,
            "digest": self.digest,
            "path": str(self.path) if self.path else None,
            "url": self.url,
            "weight_bits": self.weight_bits,
        }


def resolve_side(spec: str, role: str = "side") -> SideSpec:
    """Classify a side spec; raises UsageError naming the spec and what would work."""
    if spec.startswith(("http://", "https://")):
        return SideSpec(spec, "http", spec, spec, url=spec.rstrip("/"))
    path = Path(spec).expanduser()
    if (path / MANIFEST).is_file():
        manifest = load_manifest(path)
        bits = (manifest.recipe.get("quantization") or {}).get("weight_bits")
        return SideSpec(
            spec,
            "artifact",
            manifest.name,
            manifest.digest,
            path=path.resolve(),
            weight_bits=int(bits) if bits else None,
        )
    if not path.is_dir():
        for resolver in _SOURCE_RESOLVERS:
            resolved = resolver(spec)
            if resolved is not None:
                path = Path(resolved)
                break
    if (path / "config.json").is_file():
        files = {
            rel: info
            for rel, info in file_digests(path).items()
            if not rel.startswith(".")  # caches and lock files beside the checkpoint
        }
        return SideSpec(spec, "source", path.name, content_digest(files), path=path.resolve())
    raise UsageError(
        f"{role} {spec!r}: not a kiln artifact (no {MANIFEST}), not a Hugging Face checkpoint "
        "directory (no config.json), and not an http(s):// endpoint URL; pass one of those"
    )


# --- shadow sides -----------------------------------------------------------------------


class HttpSide:
    """An OpenAI-compatible endpoint, called with `stream: true`."""

    def __init__(self, url: str, model: str | None = None, timeout_s: float = 300.0) -> None:
        base = url.rstrip("/")
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base
        self.name = url
        self.model = model
        self._client = httpx.Client(timeout=timeout_s)

    def _model_name(self) -> str | None:
        """The served model's id from /v1/models when none was given (None if unknown)."""
        if self.model is None:
            try:
                listed = self._client.get(f"{self.base}/v1/models").json()
                self.model = str(listed["data"][0]["id"])
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
                self.model = ""
        return self.model or None

    def complete(self, record: TrafficRecord) -> SideResponse:
        body = dict(record.request)
        model = self._model_name()
        if model:
            body["model"] = model
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        texts: list[str] = []
        chunks, usage_tokens, finish = 0, None, None
        first = last = None
        sent = time.perf_counter()
        try:
            with self._client.stream("POST", self.base + record.endpoint, json=body) as resp:
                if resp.status_code >= 400:
                    detail = resp.read().decode(errors="replace")[:300]
                    return SideResponse(error=f"HTTP {resp.status_code}: {detail}")
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[len("data:") :].strip()
                    if payload == "[DONE]":
                        break
                    event = json.loads(payload)
                    if event.get("usage"):
                        usage_tokens = event["usage"].get("completion_tokens")
                    for choice in event.get("choices") or []:
                        piece = _choice_text(choice, record.is_chat)
                        finish = choice.get("finish_reason") or finish
                        if piece:
                            now = time.perf_counter()
                            first = first if first is not None else now
                            last = now
                            chunks += 1
                            texts.append(piece)
        except (httpx.HTTPError, ValueError) as exc:
            return SideResponse(text="".join(texts), error=f"{type(exc).__name__}: {exc}")
        tokens = usage_tokens or chunks
        ttft = first - sent if first is not None else None
        tpot = (last - first) / (tokens - 1) if first is not None and last and tokens > 1 else None
        return SideResponse("".join(texts), None, ttft, tpot, None, finish)

    def close(self) -> None:
        self._client.close()


def _choice_text(choice: dict[str, Any], chat: bool) -> str:
    if chat:
        return str((choice.get("delta") or {}).get("content") or "")
    return str(choice.get("text") or "")


def sampling_from_request(request: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keyword arguments from an OpenAI request body."""
    stop = request.get("stop") or []
    kwargs: dict[str, Any] = {
        "max_tokens": int(request.get("max_tokens") or request.get("max_completion_tokens") or 16),
        "temperature": float(request.get("temperature", 1.0)),
        "top_p": float(request.get("top_p", 1.0)),
        "stop": [stop] if isinstance(stop, str) else list(stop),
    }
    if request.get("seed") is not None:
        kwargs["seed"] = int(request["seed"])
    return kwargs


def prompt_token_ids(tokenizer: Any, record: TrafficRecord) -> list[int]:
    """Token ids of a request: the chat template for chats, the plain prompt otherwise."""
    if record.is_chat:
        text = tokenizer.apply_chat_template(
            record.request["messages"], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    return list(tokenizer(record.prompts()[0])["input_ids"])


class EngineSide:
    """kiln's runtime engine on an artifact (what ships) or a float source directory."""

    def __init__(self, engine: Any, name: str) -> None:
        self.engine = engine
        self.name = name
        self._lock = threading.Lock()  # the engine is stepped by one caller at a time

    @classmethod
    def load(cls, side: SideSpec, **engine_config: Any) -> EngineSide:
        """Load the runtime engine for an artifact or source side."""
        from runtime import Engine

        if side.path is None:
            raise UsageError(f"{side.spec}: an http side is served by HttpSide, not the engine")
        if side.kind == "artifact":
            return cls(Engine.from_artifact(side.path, **engine_config), side.name)
        return cls(Engine.from_pretrained(side.path, **engine_config), side.name)

    def complete(self, record: TrafficRecord) -> SideResponse:
        from runtime import SamplingParams

        try:
            ids = prompt_token_ids(self.engine.tokenizer, record)
            params = SamplingParams(**sampling_from_request(record.request))
        except (UsageError, ValueError, TypeError) as exc:
            return SideResponse(error=f"bad request: {exc}")
        texts: list[str] = []
        tokens: list[int] = []
        finish = None
        first = None
        with self._lock:
            sent = time.perf_counter()
            try:
                rid = self.engine.add_request(ids, params)
            except UsageError as exc:
                return SideResponse(error=exc.message)
            done = False
            while not done:
                deltas = self.engine.step()
                if not deltas and not self.engine.has_unfinished_requests():
                    return SideResponse("".join(texts), tokens, error="engine dropped the request")
                for delta in deltas:  # one request at a time: only ours
                    if delta.request_id != rid:
                        continue
                    if delta.token_ids and first is None:
                        first = time.perf_counter()
                    texts.append(delta.text)
                    tokens += delta.token_ids
                    if delta.finished:
                        done, finish = True, delta.finish_reason
            end = time.perf_counter()
        ttft = first - sent if first is not None else None
        tpot = (end - first) / (len(tokens) - 1) if first is not None and len(tokens) > 1 else None
        return SideResponse("".join(texts), tokens, ttft, tpot, None, finish)
