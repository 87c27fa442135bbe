"""Request bodies within bounds, before any route reads them: a body over `max_bytes`
(declared by Content-Length, or counted as it arrives) is answered 413, and a body that
stops arriving for `timeout_s` is answered 408, so neither a huge upload nor a client that
trickles one holds a worker. Plain ASGI around the app: it sees the bytes before FastAPI
parses them (a refusal while a route reads is an HTTPException, answered in OpenAI's shape).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from starlette.exceptions import HTTPException

from kiln.runtime.server.protocol import error_body

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

DEFAULT_MAX_BYTES = 4 << 20  # 4 MiB: a 128k-token prompt is well under 1 MiB of text
DEFAULT_TIMEOUT_S = 30.0


class BodyLimits:
    """ASGI middleware bounding every HTTP request body in size and in stall time."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout_s: float) -> None:
        self.app, self.max_bytes, self.timeout_s = app, max_bytes, timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            body = error_body(self.too_large(int(declared)), "invalid_request_error", 413)
            data = json.dumps(body).encode()
            await send({"type": "http.response.start", "status": 413,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(data)).encode())]})  # fmt: skip
            await send({"type": "http.response.body", "body": data})
            return
        seen = 0

        async def bounded() -> Message:
            nonlocal seen
            try:
                message = await asyncio.wait_for(receive(), self.timeout_s)
            except TimeoutError:
                raise HTTPException(
                    408,
                    f"the request body stalled for {self.timeout_s:g} s; "
                    "send it whole (kiln serve --body-timeout)",
                ) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise HTTPException(413, self.too_large(seen))
            return message

        await self.app(scope, bounded, send)

    def too_large(self, size: int) -> str:
        return (
            f"the request body is {size:,} bytes, over this server's limit of "
            f"{self.max_bytes:,}; send less, or raise kiln serve --max-request-bytes"
        )
