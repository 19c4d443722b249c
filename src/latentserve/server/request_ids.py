"""Request ids: the one a client sees, and the unique ones the engine is given."""

from __future__ import annotations

import re
import uuid

_SAFE = re.compile(r"[^A-Za-z0-9._:-]")
MAX_CLIENT_ID_CHARS = 128


def public_id(given: str) -> str:
    """A client's ``X-Request-Id`` cut to 128 characters, others than ``[A-Za-z0-9._:-]`` ``_``."""
    return _SAFE.sub("_", given)[:MAX_CLIENT_ID_CHARS]


def echoing(scope, send):
    """``send`` that puts the request's ``X-Request-Id`` (:func:`public_id`) on the response,
    as vLLM's server does; ``send`` itself for a request without one."""
    raw = next((v for k, v in scope.get("headers", []) if k.lower() == b"x-request-id"), None)
    given = public_id(raw.decode("latin-1")) if raw else None
    if not given:
        return send

    async def echoing_send(message):
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", [])
                       if k.lower() != b"x-request-id"]
            message = {**message, "headers": [*headers, (b"x-request-id", given.encode("latin-1"))]}
        await send(message)

    return echoing_send


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
