"""Request ids: the one a client sees, and the unique ones the engine is given."""

from __future__ import annotations

import re
import uuid

_SAFE = re.compile(r"[^A-Za-z0-9._:-]")
MAX_CLIENT_ID_CHARS = 128


def new_request_id(request, prefix: str) -> tuple[str, str]:
    """``(response_id, engine_rid_base)`` for one HTTP request.

    A client may name its request with an ``X-Request-Id`` header (vLLM does the same); the
    response then carries that id (cut to 128 characters, characters outside
    ``[A-Za-z0-9._:-]`` replaced by ``_``). Client ids need not be unique, so the engine
    never sees them alone: ``engine_rid_base`` always ends with a fresh UUID, and two
    requests with the same id run side by side without harm. Without the header both are
    ``{prefix}-{uuid}``.
    """
    fresh = uuid.uuid4().hex
    given = request.headers.get("x-request-id") if request is not None else None
    if given:
        public = _SAFE.sub("_", given)[:MAX_CLIENT_ID_CHARS]
        return public, f"{public}-{fresh}"
    rid = f"{prefix}-{fresh}"
    return rid, rid
