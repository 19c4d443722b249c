"""Request ids: the one a client sees, and the unique ones the engine is given."""

from __future__ import annotations

import re
import uuid

_SAFE = re.compile(r"[^A-Za-z0-9._:-]")
MAX_CLIENT_ID_CHARS = 128


def public_id(given: str) -> str:
    """A client's ``X-Request-Id`` cut to 128 characters, others than ``[A-Za-z0-9._:-]`` ``_``."""
    return _SAFE.sub("_", given)[:MAX_CLIENT_ID_CHARS]


class RequestIdEcho:
    """Pure ASGI middleware: every response carries the request's ``X-Request-Id`` back
    (:func:`public_id`), as vLLM's server does."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        raw = next((v for k, v in scope.get("headers", []) if k.lower() == b"x-request-id"),
                   None) if scope["type"] == "http" else None
        given = public_id(raw.decode("latin-1")) if raw else None
        if not given:
            return await self.app(scope, receive, send)

        async def echoing_send(message):
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", [])
                           if k.lower() != b"x-request-id"]
                headers.append((b"x-request-id", given.encode("latin-1")))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, echoing_send)


def new_request_id(request, prefix: str) -> tuple[str, str]:
    """``(response_id, engine_rid_base)``: :func:`public_id` of ``X-Request-Id`` or
    ``{prefix}-{uuid}``; the engine id always ends with a fresh UUID."""

    fresh = uuid.uuid4().hex
    given = request.headers.get("x-request-id") if request is not None else None
    if given:
        public = public_id(given)
        return public, f"{public}-{fresh}"
    rid = f"{prefix}-{fresh}"
    return rid, rid
