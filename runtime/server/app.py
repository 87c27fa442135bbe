"""The FastAPI app: OpenAI routes, /v1/models, /health, /metrics, errors in OpenAI's shape.

Lifecycle: the backend starts with the app and a one-token warm-up request runs through
it; /health answers 503 until that finished, then 200, and 503 again while draining.
Requests arriving before warm-up get 503 with Retry-After. On shutdown the server stops
taking requests, waits for the in-flight ones (uvicorn's graceful shutdown, see runner.py),
then stops the engine thread and the mirror.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from pathlib import PurePath
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_fastapi_instrumentator import Instrumentator
from starlette.exceptions import HTTPException as StarletteHTTPException

from kiln.runtime.base.errors import KilnError, UsageError
from kiln.runtime.engine.sampling import SamplingParams
from kiln.runtime.server import routes
from kiln.runtime.server.auth import require_api_key
from kiln.runtime.server.backends.native import Backend
from kiln.runtime.server.body_limits import BodyLimits
from kiln.runtime.server.metrics import CONTENT_TYPE, ServerMetrics
from kiln.runtime.server.mirror import Mirror
from kiln.runtime.server.protocol import error_body, now
from kiln.runtime.server.record import TrafficRecorder
from kiln.runtime.server.state import APIError, ServerConfig, ServerState

log = logging.getLogger("kiln.serve")
DRAIN_POLL_S = 0.05


class _ErrorResponse(JSONResponse):
    """An error body in ASCII JSON: a message that quotes a client's text stays encodable
    (and the connection open) even when that text is not valid Unicode."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


def _error(status: int, message: str, kind: str, param: str | None = None,
           headers: Mapping[str, str] | None = None) -> JSONResponse:  # fmt: skip
    return _ErrorResponse(error_body(message, kind, status, param), status, headers=headers)


# How pydantic names the member of a union it tried, inside an error's location.
_VARIANT = re.compile(r"^(str|int|float|bool|list|dict|none)$|[\[\-(]")


def _field(loc: Any) -> str:
    """An error's location as clients write the field: `messages[0].content`, with the
    union member pydantic tried at the end (`(as list[TextPart])`)."""
    path, tried = "", []
    for part in loc:
        if part == "body":
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif _VARIANT.search(str(part)):
            tried.append(str(part))
        else:
            path += f".{part}" if path else str(part)
    return path + (f" (as {', '.join(tried)})" if tried else "")


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """One readable line per problem; the first offending field as `param` (a check of the
    whole body names its field in its context's `param`)."""
    lines, param = [], None
    for error in exc.errors():
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        if error.get("type") == "json_invalid":
            return f"malformed JSON body: {error.get('msg')}", None
        named = (error.get("ctx") or {}).get("param")
        param = param or (loc[0] if loc else named if named != "body" else None)
        where = _field(error.get("loc", ())) or "body"
        lines.append(f"{where}: {error.get('msg')}" if named is None else str(error.get("msg")))
    return "invalid request: " + "; ".join(lines), param


async def _warm_up(state: ServerState) -> None:
    """One greedy token through the whole path, so the first client is not the one who
    pays for lazy initialisation."""
    backend = state.backend
    try:
        ids = backend.tokens.encode("Hello")[:8] or [0]
        params = SamplingParams(max_tokens=1, temperature=0.0)
        async for _ in backend.generate(ids, params, "kiln-warmup"):
            pass
        state.ready = True
        log.info("warm-up done; serving %s", state.config.model_name)
    except Exception as exc:  # reported by /health; the server stays up to say why
        state.warmup_error = f"{type(exc).__name__}: {exc}"
        log.error("warm-up failed: %s", state.warmup_error)


def create_app(
    backend: Backend,
    config: ServerConfig,
    recorder: TrafficRecorder | None = None,
    mirror: Mirror | None = None,
    drain_timeout_s: float = 30.0,
    digest: str = "",
) -> FastAPI:
    """An OpenAI-compatible app serving `backend`."""
    metrics = ServerMetrics(backend.stats, config.model_name, backend.max_model_len)
    state = ServerState(backend, config, metrics, recorder, mirror, digest=digest)
    state.extra["digest"] = digest
    # With API keys the schema needs a key too, and the browser pages (which fetch the
    # schema without one) are not served.
    open_docs = not config.api_keys
    app = FastAPI(title="kiln serve", version="1", lifespan=_lifespan(state, drain_timeout_s),
                  summary="OpenAI-compatible serving of kiln artifacts",
                  openapi_url="/openapi.json" if open_docs else None,
                  docs_url="/docs" if open_docs else None,
                  redoc_url="/redoc" if open_docs else None)  # fmt: skip
    app.state.kiln = state
    # vLLM's HTTP metrics (http_requests_total, http_request_duration_seconds, ...), from the
    # library vLLM uses, into the same registry; /metrics and /health are not counted.
    Instrumentator(excluded_handlers=["/metrics", "/health"],
                   registry=metrics.registry).instrument(app)  # fmt: skip
    app.add_middleware(
        BodyLimits, max_bytes=config.max_request_bytes, timeout_s=config.body_timeout_s
    )

    if not open_docs:

        @app.get("/openapi.json", dependencies=[Depends(require_api_key)],
                 include_in_schema=False)  # fmt: skip
        async def openapi() -> dict[str, Any]:
            return app.openapi()

    _error_handlers(app)
    _service_routes(app, state)
    routes.register(app)
    return app


def _lifespan(state: ServerState, drain_timeout_s: float) -> Callable[[FastAPI], Any]:
    """Start the backend (and mirror) and warm up; on shutdown drain, then stop them."""
    backend, mirror, config = state.backend, state.mirror, state.config

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        backend.start()
        if mirror is not None:
            mirror.start()
        warm = None
        if config.warmup:
            warm = asyncio.ensure_future(_warm_up(state))
        else:
            state.ready = True
        try:
            yield
        finally:
            state.draining = True
            if warm is not None and not warm.done():
                warm.cancel()
            waited = 0.0
            while state.in_flight > 0 and waited < drain_timeout_s:
                await asyncio.sleep(DRAIN_POLL_S)
                waited += DRAIN_POLL_S
            await asyncio.to_thread(backend.shutdown)
            if mirror is not None:
                await asyncio.to_thread(mirror.shutdown)

    return lifespan


def _error_handlers(app: FastAPI) -> None:
    """Every error answered in OpenAI's shape: expected ones 4xx, the rest 500 (logged)."""

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.kind, exc.param, exc.headers)

    @app.exception_handler(KilnError)
    async def kiln_error(request: Request, exc: KilnError) -> JSONResponse:
        if isinstance(exc, UsageError):
            return _error(400, exc.message, "invalid_request_error", getattr(exc, "param", None))
        return _error(500, exc.message, "server_error")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(exc.status_code, str(exc.detail), kind, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return _error(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")


def _service_routes(app: FastAPI, state: ServerState) -> None:
    """/health, /v1/models and /metrics."""
    config, backend = state.config, state.backend

    @app.get("/health")
    async def health() -> Response:
        """200 once warm-up has finished; 503 before, after a failed warm-up, and while
        draining."""
        if state.ready and not state.draining:
            return Response(status_code=200)
        reason = state.warmup_error or ("draining" if state.draining else "warming up")
        return _error(503, f"not ready: {reason}", "service_unavailable")

    @app.get("/v1/models", dependencies=[Depends(require_api_key)])
    async def models() -> dict[str, Any]:
        card = {
            "id": config.model_name,
            "object": "model",
            "created": now(),
            "owned_by": "kiln",
            # The artifact's name, never where it lies on the host.
            "root": PurePath(config.model_root).name or config.model_name,
            "max_model_len": backend.max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)
