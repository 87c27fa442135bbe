"""The two sides a gate compares: what a side spec names, and the replay `Side`s that answer.

A side spec is one of
- a kiln artifact directory (has `manifest.json`): evaluated through kiln's runtime;
- a model source: a local Hugging Face checkpoint directory (the float baseline), or any
  spec a registered resolver turns into one (the compiler registers `builtin:` and GGUF);
- an http(s) URL of an OpenAI-compatible endpoint (`/v1/completions`, `/v1/chat/completions`).

`HttpSide` streams (SSE) through `runtime.client` to measure TTFT and TPOT as
`vllm bench serve` defines them: TTFT = first content chunk - request sent;
TPOT = (latency - TTFT) / (output tokens - 1).
`EngineSide` runs requests through `runtime.Engine` one at a time, so the per-request
timings are the engine's own, not a queue's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kiln.runtime.base.errors import UsageError
from kiln.runtime.client.http import OpenAIClient, base_url
from kiln.runtime.engine.answer import answer_alone
from kiln.runtime.formats.artifact import MANIFEST, content_digest, file_digests
from kiln.runtime.formats.artifact.verified import Mode, verify_artifact
from kiln.runtime.formats.side_answer import SideAnswer
from kiln.runtime.formats.traffic import TrafficRecord

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


def resolve_side(spec: str, role: str = "side", verify: Mode = "fast") -> SideSpec:
    """Classify a side spec; raises UsageError naming the spec and what would work. An
    artifact is checked against its manifest first (`verify`: fast or full, see
    runtime.artifact.verified): a gate measures only what its digest names."""
    if spec.startswith(("http://", "https://")):
        return SideSpec(spec, "http", spec, spec, url=base_url(spec))
    path = Path(spec).expanduser()
    if (path / MANIFEST).is_file():
        manifest = verify_artifact(path, mode=verify, action=f"gate it as the {role}").manifest
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


def check_distinct(cand: SideSpec, base: SideSpec, recording: bool) -> None:
    """Refuse gating an artifact against itself: such a pass says nothing. Two copies of the
    same content may be compared (serving determinism, say), but never recorded as a gate
    run. (An endpoint's URL does not name its content, so equal URLs are not refused.)"""
    if cand.kind == "http" or cand.digest != base.digest:
        return
    same = f"candidate {cand.spec} and baseline {base.spec}"
    if cand.path == base.path:
        raise UsageError(
            f"{same} are the same {cand.kind}; a gate compares two things: pass the baseline "
            "the candidate must not be worse than (its float source, or what serves now)"
        )
    if recording:
        raise UsageError(
            f"{same} hold the same content ({cand.digest[:12]}); such a run proves nothing and "
            "is not recorded: gate against another baseline, or pass --no-record to compare "
            "the two copies anyway"
        )


# --- replay sides -----------------------------------------------------------------------


class HttpSide:
    """An OpenAI-compatible endpoint, called with `stream: true` through runtime.client."""

    def __init__(
        self,
        url: str,
        model: str | None = None,
        timeout_s: float = 300.0,
        api_key: str | None = None,
    ) -> None:
        self.name = url
        self._client = OpenAIClient(url, model, timeout_s, api_key)
        self.base = self._client.base
        self._model_known = model is not None

    def _resolve_model(self) -> None:
        """Ask /v1/models for the served model's id once, when none was given."""
        if not self._model_known:
            self._model_known = True
            try:
                self._client.model = self._client.first_model()
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
                self._client.model = None  # the server picks its default model

    def complete(self, record: TrafficRecord) -> SideAnswer:
        self._resolve_model()
        result = self._client.stream(record.endpoint, record.request)
        if result.error is not None:
            return SideAnswer(text=result.text, error=result.error)
        return SideAnswer(result.text, None, result.ttft_s, result.tpot_s, result.finish_reason)

    def close(self) -> None:
        self._client.close()


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


class EngineSide:
    """kiln's runtime engine on an artifact (what ships) or a float source directory."""

    def __init__(self, engine: Any, name: str) -> None:
        self.engine = engine
        self.name = name
        self._lock = threading.Lock()  # the engine is stepped by one caller at a time

    @classmethod
    def load(cls, side: SideSpec, **engine_config: Any) -> EngineSide:
        """Load the runtime engine for an artifact or source side."""
        from kiln.runtime import Engine

        if side.path is None:
            raise UsageError(f"{side.spec}: an http side is served by HttpSide, not the engine")
        return cls(Engine.load(side.path, **engine_config), side.name)

    def complete(self, record: TrafficRecord) -> SideAnswer:
        from kiln.runtime import SamplingParams

        try:
            params = SamplingParams(**sampling_from_request(record.request))
        except (UsageError, ValueError, TypeError) as exc:
            return SideAnswer(error=f"bad request: {exc}")
        with self._lock:
            if record.is_chat:
                return answer_alone(self.engine, params, messages=record.request["messages"])
            return answer_alone(self.engine, params, record.prompts()[0])
