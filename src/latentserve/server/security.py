"""ASGI middleware for the API key, the request body size limit, JSON bodies and request ids.
Design notes: docs/internals.md, "latentserve.server.security"."""

from __future__ import annotations

import hmac

from latentserve.server.errors import APIError, error_response
from latentserve.server.request_ids import echoing

# The interactive docs and the schema describe every route: behind the key as the API is.
_DOCS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


class GuardMiddleware:
    """Pure ASGI middleware (streaming-safe, unlike ``BaseHTTPMiddleware``): ``api_key``
    (None: open) and ``max_body_bytes``; a POST whose ``Content-Type`` is missing or not JSON
    reaches the app as ``application/json`` (its body is parsed as JSON); a compressed POST
    body (``Content-Encoding`` other than identity) is a 415; every response (401, 413 and 415
    too) echoes ``X-Request-Id`` (``request_ids.echoing``)."""

    def __init__(self, app, api_key: str | None, max_body_bytes: int):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.too_large = f"Request body is larger than the limit of {max_body_bytes} bytes"

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.decode("latin-1").lower(): v for k, v in scope.get("headers", [])}
        send = echoing(headers.get("x-request-id"), send)
        path = scope.get("path", "")
        protected = path.startswith("/v1/") or path in ("/tokenize", "/detokenize", *_DOCS)
        if self.api_key is not None and protected and not self._authorized(headers):
            response = error_response(path, APIError(
                "Invalid or missing API key; send it as 'Authorization: Bearer <key>' or "
                "'x-api-key: <key>'", status_code=401, code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"}))
            return await response(scope, receive, send)
        length = headers.get("content-length", b"").strip()
        if length.isdigit() and int(length) > self.max_body_bytes:
            response = error_response(path, APIError(self.too_large, status_code=413,
                                                     code="request_too_large"))
            return await response(scope, receive, send)
        encoding = headers.get("content-encoding", b"identity").strip().lower()
        if scope.get("method") == "POST" and encoding not in (b"identity", b""):
            response = error_response(path, APIError(
                f"Content-Encoding {encoding.decode('latin-1')!r} is not supported; send the "
                "body uncompressed", status_code=415, code="unsupported_content_encoding"))
            return await response(scope, receive, send)
        media = headers.get("content-type", b"").split(b";", 1)[0].strip().lower()
        if scope.get("method") == "POST" and not (media == b"application/json"
                                                  or media.endswith(b"+json")):
            scope = {**scope, "headers": [*((k, v) for k, v in scope.get("headers", [])
                                            if k.lower() != b"content-type"),
                                          (b"content-type", b"application/json")]}
        limit, seen = self.max_body_bytes, 0

        async def counted_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    from starlette.exceptions import HTTPException

                    raise HTTPException(413, self.too_large)
            return message

        await self.app(scope, counted_receive, send)

    def _authorized(self, headers: dict[str, bytes]) -> bool:
        auth = headers.get("authorization", b"")
        keys = [auth[7:]] if auth[:7].lower() == b"bearer " else []
        keys += [headers["x-api-key"]] if "x-api-key" in headers else []
        return any(hmac.compare_digest(k.strip(), self.api_key) for k in keys)

