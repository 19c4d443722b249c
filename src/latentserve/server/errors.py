"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}``.

Every failure leaves the server in that shape: our own :class:`APIError`, request
validation (wrong types, missing fields, malformed JSON: 400, not FastAPI's 422), routing
errors (404/405) and, with a generic message and no stack trace, anything unexpected (500).
"""

from __future__ import annotations

import logging
import re
from typing import Any

log = logging.getLogger(__name__)

_NOT_A_FIELD = {"str", "int", "float", "bool", "none", "list", "dict"}


class APIError(Exception):
    """An error answered to the client as an OpenAI error body."""

    def __init__(self, message: str, *, status_code: int = 400, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.type = type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    """The OpenAI error object."""
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def param_from_value_error(message: str) -> str | None:
    """The field a ``SamplingParams`` error names first (``"top_p must be ..."`` -> top_p)."""
    match = re.match(r"([A-Za-z_][A-Za-z0-9_]*)", message)
    return match.group(1) if match else None


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """Turn pydantic/FastAPI request-validation errors into one 400 naming the first bad field.

    Union members' tags (``prompt -> list[int] -> 1``) are dropped from the field path, so
    ``param`` is what the client sent (``prompt``, ``messages[0].role``).
    """
    if not errors:
        return APIError("Invalid request")
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        return APIError(f"Malformed JSON body: {detail}", code="invalid_json")
    if loc in (("body",), ()):
        if first.get("type") == "missing":
            return APIError("Request body is missing; send a JSON object")
        return APIError("Request body must be a JSON object", code="invalid_json")
    param = _param(loc)
    if first.get("type") == "missing":
        return APIError(f"Missing required parameter: '{param}'", param=param,
                        code="missing_required_parameter")
    same = [e for e in errors if _param(tuple(e.get("loc", ()))) == param]
    reasons = "; ".join(dict.fromkeys(e.get("msg", "invalid") for e in same))
    got = _short(first.get("input"))
    return APIError(f"Invalid type for '{param}': {reasons} (got {got})", param=param,
                    code="invalid_type")


def _param(loc: tuple) -> str:
    path = ""
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _is_field(part):
            path += f".{part}" if path else part
        else:
            break  # a union member's tag: "str", "list[int]", "StreamOptions", ...
    return path or "body"


def _is_field(part: object) -> bool:
    return (isinstance(part, str) and part.isidentifier() and part == part.lower()
            and part not in _NOT_A_FIELD)


def _short(value: object, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def install_error_handlers(app) -> None:
    """Register the handlers that keep every error response in the OpenAI shape."""
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException

    async def on_api_error(request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status_code)

    async def on_validation(request, exc: RequestValidationError):
        err = validation_error(list(exc.errors()))
        return JSONResponse(err.body(), status_code=err.status_code)

    async def on_http(request, exc: HTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return JSONResponse(error_body(str(exc.detail), kind), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    async def on_unexpected(request, exc: Exception):
        log.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body("Internal server error", "server_error"),
                            status_code=500)

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(HTTPException, on_http)
    app.add_exception_handler(Exception, on_unexpected)
