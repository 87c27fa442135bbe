"""`kiln serve`: an OpenAI-compatible HTTP server over kiln's runtime (or TensorRT-LLM).

Needs the `serve` extra (fastapi, uvicorn, prometheus-client); names load on first use so
`runtime.server.mirror_log` (read by the gate) needs none of them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kiln.runtime import lazy_exports

if TYPE_CHECKING:
    from kiln.runtime.server.app import create_app as create_app
    from kiln.runtime.server.backends.native import NativeBackend as NativeBackend
    from kiln.runtime.server.mirror import Mirror as Mirror
    from kiln.runtime.server.record import RecordSettings as RecordSettings
    from kiln.runtime.server.record import TrafficRecorder as TrafficRecorder
    from kiln.runtime.server.runner import serve as serve
    from kiln.runtime.server.state import ServerConfig as ServerConfig

_EXPORTS = {
    "create_app": "kiln.runtime.server.app",
    "NativeBackend": "kiln.runtime.server.backends.native",
    "Mirror": "kiln.runtime.server.mirror",
    "RecordSettings": "kiln.runtime.server.record",
    "TrafficRecorder": "kiln.runtime.server.record",
    "serve": "kiln.runtime.server.runner",
    "ServerConfig": "kiln.runtime.server.state",
}

__all__ = sorted(_EXPORTS)
__getattr__ = lazy_exports(__name__, _EXPORTS)
