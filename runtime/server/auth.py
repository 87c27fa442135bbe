"""Optional API keys: `Authorization: Bearer <key>` on /v1 routes when keys are configured."""

from __future__ import annotations

import hmac

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from kiln.runtime.server.state import APIError

# auto_error off: a missing key is our 401 with OpenAI's body, not FastAPI's 403.
_bearer = HTTPBearer(auto_error=False, description="Needed when the server runs with --api-key")
_CREDENTIALS = Depends(_bearer)


async def require_api_key(
    request: Request, credentials: HTTPAuthorizationCredentials | None = _CREDENTIALS
) -> None:
    """Refuse the request (401) unless it carries one of the server's keys."""
    keys = request.app.state.kiln.config.api_keys
    if not keys:
        return
    token = credentials.credentials if credentials is not None else ""
    if not any(hmac.compare_digest(token.encode(), key.encode()) for key in keys):
        raise APIError(
            401,
            "invalid or missing API key: send `Authorization: Bearer <key>`",
            "authentication_error",
        )
