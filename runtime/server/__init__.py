"""`kiln serve`: an OpenAI-compatible HTTP server over kiln's runtime (or TensorRT-LLM).

Needs the `serve` extra (fastapi, uvicorn, prometheus-client); names load on first use so
`runtime.server.shadow_log` (read by the gate) needs none of them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.server.app import create_app as create_app
    from runtime.server.backend import NativeBackend as NativeBackend
    from runtime.server.record import RecordSettings as RecordSettings
    from runtime.server.record import TrafficRecorder as TrafficRecorder
    from runtime.server.runner import serve as serve
    from runtime.server.shadow import ShadowMirror as ShadowMirror
    from runtime.server.state import ServerConfig as ServerConfig

_EXPORTS = {
    "create_app": "runtime.server.app",
    "NativeBackend": "runtime.server.backend",
    "RecordSettings": "runtime.server.record",
    "TrafficRecorder": "runtime.server.record",
    "serve": "runtime.server.runner",
    "ShadowMirror": "runtime.server.shadow",
    "ServerConfig": "runtime.server.state",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'runtime.server' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
