"""Request ids: the one a client sees, and the unique ones the engine is given."""

from __future__ import annotations

import re
import uuid

_SAFE = re.compile(r"[^A-Za-z0-9._:-]")
MAX_CLIENT_ID_CHARS = 128


def public_id(given: str) -> str:
    """A client's ``X-Request-Id`` cut to 128 characters, others than ``[A-Za-z0-9._:-]`` ``_``."""
    return _SAFE.sub("_", given)[:MAX_CLIENT_ID_CHARS]


def echoing(given: bytes | None, send):
    """``send`` that puts the request's ``X-Request-Id`` header value ``given`` (as
    :func:`public_id`) on the response, as vLLM's server does; ``send`` itself for none."""
    public = public_id(given.decode("latin-1")).encode("latin-1") if given else b""
    if not public:
        return send

    async def echoing_send(message):
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", [])
                       if k.lower() != b"x-request-id"]
            message = {**message, "headers": [*headers, (b"x-request-id", public)]}
        await send(message)

    return echoing_send


def new_request_id(request, prefix: str) -> tuple[str, str]:
    """``(response_id, engine_rid_base)``: :func:`public_id` of ``X-Request-Id`` or
    ``{prefix}-{uuid}``; the engine id always ends with a fresh UUID."""
    fresh = uuid.uuid4().hex
    if given := request.headers.get("x-request-id"):
        return public_id(given), f"{public_id(given)}-{fresh}"
    return f"{prefix}-{fresh}", f"{prefix}-{fresh}"
