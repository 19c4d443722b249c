"""``/openapi.json`` with the error responses each route really sends, in its protocol's
body, and without FastAPI's 422 (validation errors are 400s)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from latentserve.server.errors import is_anthropic_path


class OpenAIErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class OpenAIError(BaseModel):
    """OpenAI's error body (every route but ``/v1/messages``)."""

    error: OpenAIErrorDetail


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error body (``/v1/messages``, ``/v1/messages/count_tokens``)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


_WHY = {
    400: "invalid request: a wrong type, a value out of range, a field not implemented "
         "(named in param), a prompt over the context",
    401: "missing or wrong API key (with --api-key)",
    404: "no such model, or no such route",
    413: "request body over --max-request-body-bytes",
    415: "a compressed body (Content-Encoding other than identity)",
    503: "overloaded (Retry-After; --max-waiting-requests, --queue-timeout) or the engine is "
         "gone",
    529: "overloaded (Anthropic's overloaded_error, with Retry-After)",
}


def error_responses(path: str, method: str) -> dict[str, dict]:
    """The OpenAPI error responses of route ``method path`` by status, each a reference to
    its protocol's error body in ``#/components/schemas``."""
    model = AnthropicError if is_anthropic_path(path) else OpenAIError
    if path == "/health":
        codes = [404, 503]
    elif path.startswith("/v1/") or path in ("/tokenize", "/detokenize"):
        codes = [401, 404] + ([400, 413, 415, 503] if method == "POST" else [])
        if is_anthropic_path(path) and method == "POST":
            codes.append(529)
    else:
        codes = []
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {str(c): {"description": _WHY[c], "content": {"application/json": {
        "schema": schema}}} for c in sorted(codes)}


def declare_errors(app) -> None:
    """Make ``app``'s schema list :func:`error_responses` on every route and no 422; call
    after the routes are added."""

    from fastapi.openapi.utils import get_openapi
    from fastapi.routing import APIRoute

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        schemas = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        for model in (OpenAIError, AnthropicError):
            body = model.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(body.pop("$defs", {}))
            schemas[model.__name__] = body
        for route in app.routes:
            if not isinstance(route, APIRoute) or not route.include_in_schema:
                continue  # e.g. /viewer's page, not part of the API
            for method in route.methods:
                operation = schema["paths"][route.path_format][method.lower()]
                responses = operation.setdefault("responses", {})
                responses.pop("422", None)
                responses.update(error_responses(route.path_format, method))
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
