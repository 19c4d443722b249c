"""Error bodies: OpenAI's shape everywhere, Anthropic's under ``/v1/messages``.
Design notes: docs/internals.md, "latentserve.server.errors"."""

from __future__ import annotations

import logging
import re
from typing import Any

from latentserve.models.checkpoint import NoTokenizerError

log = logging.getLogger(__name__)

_NOT_A_FIELD = {"str", "int", "float", "bool", "none", "list", "dict"}


class APIError(Exception):
    """An error answered to the client as an OpenAI error body."""

    def __init__(self, message: str, *, status_code: int = 400, param: str | None = None,
                 code: str | None = None, type: str = "invalid_request_error",
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers  # response headers (Retry-After on a 503 "overloaded")

    def body(self) -> dict[str, Any]:
        """The OpenAI error object."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# Anthropic's error type of an HTTP status other than ``invalid_request_error`` (< 500) and
# ``api_error`` (a failed engine); only load shedding (529, ``overloaded``) is overloaded_error.
_ANTHROPIC_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                    413: "request_too_large", 429: "rate_limit_error", 529: "overloaded_error"}


def is_anthropic_path(path: str) -> bool:
    """Whether ``path`` is served with Anthropic's error shape."""
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def anthropic_message(err: APIError) -> str:
    """``err``'s message in Anthropic's ``field: reason`` form when it names its field in
    another (``top_p must be ...``, ``Invalid type for 'top_p': ...``, an unknown field)."""
    param, text = err.param, err.message
    if err.code == "unknown_field":
        return f"{param}: Extra inputs are not permitted"
    if not param or text.startswith(f"{param}: "):
        return text
    for lead in (f"{param} ", f"Invalid type for '{param}': "):
        if text.startswith(lead):
            return f"{param}: {text[len(lead):].removeprefix('is ')}"
    if text == f"Missing required parameter: '{param}'":
        return f"{param}: Field required"
    return text


def anthropic_error(err: APIError) -> tuple[int, dict[str, Any]]:
    """``err``'s status under ``/v1/messages`` (529 for the 503 ``overloaded``) and
    Anthropic's error object."""
    status = 529 if err.code == "overloaded" else err.status_code
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return status, {"type": "error", "error": {"type": kind, "message": anthropic_message(err)}}


def error_response(path: str, err: APIError):
    """A JSONResponse of ``err`` (with ``err.headers``) in ``path``'s protocol's shape."""
    from fastapi.responses import JSONResponse

    status, body = (anthropic_error(err) if is_anthropic_path(path)
                    else (err.status_code, err.body()))
    return JSONResponse(body, status_code=status, headers=err.headers)


def param_from_value_error(message: str) -> str | None:
    """The field a ``SamplingParams`` error names first (``"top_p must be ..."`` -> top_p;
    ``"tools[1].function.parameters is ..."`` -> that path)."""
    match = re.match(r"([A-Za-z_][A-Za-z0-9_]*(?:\[\d+\]|\.[A-Za-z0-9_]+)*)", message)
    return match.group(1) if match else None


def validation_error(errors: list[dict[str, Any]]) -> APIError:
    """One 400 naming the first bad field of pydantic's errors (union members' tags dropped
    from the path: ``prompt``, ``messages[0].role``)."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error") or first.get("msg", "")
        return APIError(f"Malformed JSON body: {detail}", code="invalid_json")
    if loc in (("body",), ()):
        if first.get("type") == "missing":
            return APIError("Request body is missing; send a JSON object", code="invalid_json")
        return APIError("Request body must be a JSON object", code="invalid_json")
    param = _split(loc)[0]
    if first.get("type") == "missing":
        return APIError(f"Missing required parameter: '{param}'", param=param,
                        code="missing_required_parameter")
    if first.get("type") == "extra_forbidden":  # a nested key no model declares
        return APIError(f"Unrecognized request argument supplied: {param}", param=param,
                        code="unknown_field")
    same = [e for e in errors if _split(e.get("loc", ()))[0] == param]
    reasons = (_union_expected(same)
               or "; ".join(dict.fromkeys(e.get("msg", "invalid") for e in same)))
    got = short_repr(first.get("input"))
    return APIError(f"Invalid type for '{param}': {reasons} (got {got})", param=param,
                    code="invalid_type")


def malformed_body(cause: BaseException | None) -> APIError:
    """The 400 ``invalid_json`` for a body unreadable for ``cause`` (not its JSON syntax):
    not UTF-8, nested too deeply, or an integer over Python's int digit limit."""
    if isinstance(cause, UnicodeDecodeError):
        detail = f"not valid UTF-8 (byte {cause.start})"
    elif isinstance(cause, RecursionError):
        detail = "it nests too deeply (arrays or objects inside one another)"
    elif isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        # json reads integers with Python's int(), limited to sys.get_int_max_str_digits()
        limit = re.search(r"\((\d+) digits\)", str(cause))
        detail = "a number in the body has too many digits" + \
            (f" (over {limit.group(1)})" if limit else "")
    else:
        detail = type(cause).__name__ if cause is not None else "unreadable"
    return APIError(f"Malformed JSON body: {detail}", code="invalid_json")


def _split(loc) -> tuple[str, tuple]:
    """A pydantic error's ``loc`` as its field's path (``messages[0].role``; ``body`` for
    none) and the rest, from a union member's tag (``str``, ``list[int]``, ``StreamOptions``)."""
    loc = tuple(loc)
    loc = loc[1:] if loc[:1] == ("body",) else loc
    path = ""
    for i, part in enumerate(loc):
        if isinstance(part, int):
            path += f"[{part}]"
        elif (isinstance(part, str) and part.isidentifier() and part == part.lower()
              and part not in _NOT_A_FIELD):
            path += f".{part}" if path else part
        else:
            return path or "body", loc[i:]
    return path or "body", ()


_KINDS = {"str": ("a string", "strings"), "int": ("an integer", "integers"),
          "float": ("a number", "numbers"), "bool": ("a boolean", "booleans")}


def _kind(tag: str, plural: bool = False) -> str | None:
    """``list[int]`` -> ``a list of integers``; a model or dict tag -> ``an object``; None
    for a tag with no plain name."""
    if tag.startswith("list[") and tag.endswith("]"):
        inner = _kind(tag[5:-1], plural=True)
        return inner and ("lists of " if plural else "a list of ") + inner
    if tag in _KINDS:
        return _KINDS[tag][plural]
    if tag.startswith("dict[") or (tag.isidentifier() and tag[:1].isupper()):
        return "objects" if plural else "an object"
    return None


def _union_expected(errors: list[dict[str, Any]]) -> str | None:
    """``expected a string or a list of strings`` when ``errors`` (one field's) are a union's
    members each refusing the value's type (``stop: [1, 2]``); else None."""
    kinds = []
    for e in errors:
        rest = _split(e.get("loc", ()))[1]  # the tag, then () or an item's index: the type
        refused = str(e.get("type", "")).endswith("_type") and 0 < len(rest) < 3 and all(
            isinstance(p, int) for p in rest[1:])
        kinds.append(_kind(str(rest[0])) if refused else None)
        if kinds[-1] is None:
            return None
    kinds = list(dict.fromkeys(kinds))
    if len(kinds) < 2:
        return None
    return f"expected {', '.join(kinds[:-1])} or {kinds[-1]}"


def short_repr(value: object, limit: int = 60) -> str:
    """``repr(value)``, cut to ``limit`` characters with ``...``."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def install_error_handlers(app) -> None:
    """Answer every error in its route's protocol's shape: validation errors, unreadable
    bodies and text to a token-ids-only model as 400s, anything unknown as a logged 500."""

    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    async def reply(request, exc: Exception):
        if isinstance(exc, APIError):
            err = exc
        elif isinstance(exc, RequestValidationError):
            err = validation_error(list(exc.errors()))
        elif isinstance(exc, HTTPException) and exc.status_code == 400:
            err = malformed_body(exc.__cause__)  # FastAPI could not read the body (not UTF-8)
        elif isinstance(exc, HTTPException):
            kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
            code = "request_too_large" if exc.status_code == 413 else None
            err = APIError(str(exc.detail), status_code=exc.status_code, type=kind, code=code,
                           headers=getattr(exc, "headers", None))
        elif isinstance(exc, NoTokenizerError):
            err = APIError(str(exc))
        else:
            log.exception("unhandled error on %s", request.url.path)
            err = APIError("Internal server error", status_code=500, type="server_error")
        return error_response(request.url.path, err)

    for cls in (APIError, RequestValidationError, HTTPException, NoTokenizerError, Exception):
        app.add_exception_handler(cls, reply)
