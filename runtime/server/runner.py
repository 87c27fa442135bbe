"""Run the app under uvicorn with a graceful SIGTERM / SIGINT drain.

On the signal uvicorn stops listening, lets every in-flight response finish (up to
`drain_timeout_s`, then cancels what is left, which aborts those engine requests), and runs
the app's shutdown (engine thread and mirror stop). /health turns 503 at the signal,
so a load balancer that still holds a connection stops sending. A drained SIGTERM exits 0.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn
from fastapi import FastAPI

log = logging.getLogger("kiln.serve")


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        state = self._app.state.kiln
        if not state.draining:
            log.info("signal %s: draining %d in-flight sequences", sig, state.in_flight)
        state.draining = True
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            # uvicorn re-raises captured signals after shutting down, so the process would
            # die by SIGTERM; a completed drain is a clean exit (status 0) instead.
            captured = getattr(self, "_captured_signals", None)
            if isinstance(captured, list) and sig in captured:
                captured.remove(sig)


def serve(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 8000,
    drain_timeout_s: float = 30.0,
    log_level: str = "info",
) -> None:
    """Serve until SIGTERM/SIGINT, then drain and return."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=int(drain_timeout_s) or None,
        timeout_keep_alive=5,
    )
    _DrainingServer(config, app).run()
