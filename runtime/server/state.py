"""The server's shared state: backend, settings, admission control, metrics, recorder, mirror."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
from dataclasses import dataclass, field
from typing import Any

from kiln.runtime.base.errors import UsageError
from kiln.runtime.server.backends.native import Backend
from kiln.runtime.server.body_limits import DEFAULT_MAX_BYTES, DEFAULT_TIMEOUT_S
from kiln.runtime.server.metrics import ServerMetrics
from kiln.runtime.server.mirror import Mirror
from kiln.runtime.server.record import TrafficRecorder

API_KEY_ENV = "KILN_API_KEY"


class APIError(Exception):
    """An error answered with OpenAI's body: status, message, type, offending parameter."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind
        self.param = param
        self.headers = headers or {}


@dataclass(slots=True)
class ServerConfig:
    """What the HTTP layer needs beyond the backend.

    Admission: at most `max_running + max_waiting` choices are in flight; more get 429
    with Retry-After. `max_running` is the engine's batch size (max_num_seqs).
    """

    model_name: str
    max_running: int = 64
    max_waiting: int = 64
    api_keys: tuple[str, ...] = ()
    retry_after_s: int = 1
    warmup: bool = True
    model_root: str = ""  # the artifact path; /v1/models shows its last part only
    store_prompts: bool = False  # mirror log keeps prompt text (same switch as --record-prompts)
    max_request_bytes: int = DEFAULT_MAX_BYTES  # a larger body is answered 413
    body_timeout_s: float = DEFAULT_TIMEOUT_S  # a body stalled this long is answered 408

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise UsageError(f"--max-waiting {self.max_waiting}: must be >= 0")
        if self.max_running < 1:
            raise UsageError(f"max_running {self.max_running}: must be >= 1")
        if self.max_request_bytes < 1:
            raise UsageError(f"--max-request-bytes {self.max_request_bytes}: must be >= 1")
        if any(not key.strip() for key in self.api_keys):
            raise UsageError("api_keys: an empty key would let every request in; drop it")
        if not 0 < self.body_timeout_s < float("inf"):
            raise UsageError(f"--body-timeout {self.body_timeout_s}: must be a positive number")

    @classmethod
    def keys_from(cls, given: tuple[str, ...] | list[str] | None) -> tuple[str, ...]:
        """API keys from --api-key options, else $KILN_API_KEY (comma-separated)."""
        if given:
            keys = tuple(given)
            source = "--api-key"
        elif API_KEY_ENV in os.environ:
            keys = tuple(k.strip() for k in os.environ[API_KEY_ENV].split(","))
            source = f"${API_KEY_ENV}"
        else:
            return ()
        if any(not k.strip() for k in keys):
            raise UsageError(
                f"{source}: an empty API key would let every request in (an empty bearer "
                f"token matches it); give a key, or unset {source} to serve without keys"
            )
        return keys


@dataclass
class ServerState:
    backend: Backend
    config: ServerConfig
    metrics: ServerMetrics
    recorder: TrafficRecorder | None = None
    mirror: Mirror | None = None
    ready: bool = False
    draining: bool = False
    in_flight: int = 0
    warmup_error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    fingerprint: str = ""
    digest: str = ""  # the artifact's content digest, where it is one

    def __post_init__(self) -> None:
        self.fingerprint = system_fingerprint(self.config, self.backend, self.digest)

    @property
    def capacity(self) -> int:
        return self.config.max_running + self.config.max_waiting

    def admit(self, choices: int) -> None:
        """Reserve room for `choices` sequences, or raise 429 (503 while not serving)."""
        if self.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable",
                           headers={"Retry-After": str(self.config.retry_after_s)})  # fmt: skip
        if not self.ready:
            raise APIError(503, "the server is warming up; retry shortly", "service_unavailable",
                           headers={"Retry-After": str(self.config.retry_after_s)})  # fmt: skip
        if choices > self.capacity:
            raise APIError(400, f"the request asks for {choices} sequences; this server takes "
                           f"at most {self.capacity} at once (lower n or send fewer prompts)",
                           param="n")  # fmt: skip
        if self.in_flight + choices > self.capacity:
            self.metrics.admission_rejections["max_num_queued_reqs"].inc()
            raise APIError(
                429,
                f"server overloaded: {self.in_flight} sequences in flight, the limit is "
                f"{self.capacity} (max_num_seqs {self.config.max_running} + max_waiting "
                f"{self.config.max_waiting}); retry after {self.config.retry_after_s}s",
                "rate_limit_exceeded",
                headers={"Retry-After": str(self.config.retry_after_s)},
            )
        self.in_flight += choices

    def release(self, choices: int) -> None:
        self.in_flight -= choices


def system_fingerprint(config: ServerConfig, backend: Backend, digest: str = "") -> str:
    """OpenAI's `system_fingerprint`, shaped as vLLM's (`vllm-<version>-<hash8>`):
    `kiln-<version>-<hash8>`, the hash over what decides the answers a client gets (the
    served model, its artifact's content digest and path, the backend, the context length),
    so a client sees when the deployment behind a name changed."""
    try:
        version = importlib.metadata.version("kiln")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    identity = [config.model_name, digest, config.model_root, backend.name, backend.max_model_len]
    hash8 = hashlib.sha256(json.dumps(identity).encode()).hexdigest()[:8]
    return f"kiln-{version}-{hash8}"
