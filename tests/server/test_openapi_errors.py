"""``/openapi.json`` declares the error responses the server really sends (issue 28,
``server/openapi.py``): each route's 400/401/404/413 answer to a bad request has the body
the schema names for that status (OpenAI's or Anthropic's), and no route lists FastAPI's 422;
a bounded schemathesis run (schema-valid and schema-invalid requests) finds no 5xx and no
schema violation."""

import httpx
import pytest
from server_testlib import API_KEY

from latentserve.server import openapi

USER = [{"role": "user", "content": "hi"}]
# A valid body per POST route, with a model that is not served (the 404 case).
BODIES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 1},
    "/v1/chat/completions": {"messages": USER, "max_tokens": 1},
    "/v1/messages": {"messages": USER, "max_tokens": 1},
    "/v1/messages/count_tokens": {"messages": USER},
    "/tokenize": {"prompt": "hi"},
    "/detokenize": {"tokens": [1]},
}


@pytest.fixture(scope="module")
def schema(server):
    return httpx.get(f"{server.base_url}/openapi.json", timeout=30,
                     headers={"Authorization": f"Bearer {API_KEY}"}).json()


def _error_model(schema, path, method, status):
    """The pydantic model the schema names for ``status`` of ``method path``."""
    ref = schema["paths"][path][method]["responses"][str(status)]["content"][
        "application/json"]["schema"]["$ref"]
    return getattr(openapi, ref.rsplit("/", 1)[1])


def _check(schema, path, method, response, status):
    assert response.status_code == status, response.text
    model = _error_model(schema, path, method, status)
    body = response.json()
    model.model_validate(body)
    assert set(body) == set(model.model_fields)


def test_no_route_documents_422(schema):
    for path, item in schema["paths"].items():
        for method, operation in item.items():
            assert "422" not in operation["responses"], (path, method)


def test_count_tokens_schema_lists_no_field_it_refuses(schema):
    """count_tokens refuses ``fields.NOT_COUNTED`` (max_tokens, stream, ...), so its request
    schema does not list them, and takes no other field."""
    from latentserve.server.fields import NOT_COUNTED

    def model(path):
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        return schema["components"]["schemas"][body["schema"]["$ref"].rsplit("/", 1)[1]]

    assert {"max_tokens", "stream", "temperature"} <= set(model("/v1/messages")["properties"])
    counted = model("/v1/messages/count_tokens")
    assert not set(NOT_COUNTED) & set(counted["properties"]) and "messages" in counted[
        "properties"] and counted["additionalProperties"] is False


@pytest.mark.parametrize("path", sorted(BODIES))
def test_post_route_errors_match_their_declared_bodies(server, schema, model, path):
    url = f"{server.base_url}{path}"
    auth = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.Client(timeout=60) as http:
        _check(schema, path, "post", http.post(url, json=[], headers=auth), 400)
        _check(schema, path, "post", http.post(url, json=BODIES[path]), 401)
        _check(schema, path, "post", http.post(
            url, json={**BODIES[path], "model": "no-such-model"}, headers=auth), 404)
        big = b"[" + b"1," * (9 * 1024 * 1024) + b"1]"  # over the 16 MiB limit
        _check(schema, path, "post", http.post(
            url, content=big, headers={**auth, "Content-Type": "application/json"}), 413)
        _check(schema, path, "post", http.post(url, content=b"x", headers={
            **auth, "Content-Type": "application/json", "Content-Encoding": "gzip"}), 415)


def test_get_model_errors_match_their_declared_bodies(server, schema):
    path = "/v1/models/{model_id}"
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        _check(schema, path, "get", http.get("/v1/models/nope"), 401)
        _check(schema, path, "get", http.get(
            "/v1/models/nope", headers={"Authorization": f"Bearer {API_KEY}"}), 404)


def _fuzz(operation, valid: bool, call, seen: dict[int, int], model: str) -> None:
    """Send 10 derandomized schemathesis cases of ``operation`` (schema-valid ones when
    ``valid``, naming ``model`` and asking for at most 4 tokens; else schema-invalid ones)
    through ``call(case)``, which validates the response; ``seen`` counts the statuses."""
    import hypothesis
    from schemathesis import GenerationMode

    mode = GenerationMode.POSITIVE if valid else GenerationMode.NEGATIVE

    @hypothesis.settings(max_examples=10, deadline=None, database=None, derandomize=True,
                         suppress_health_check=list(hypothesis.HealthCheck))
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode))
    def check(case):
        if valid and isinstance(case.body, dict):
            case.body["model"] = model
            for key in ("max_tokens", "max_completion_tokens"):
                if isinstance(case.body.get(key), int):
                    case.body[key] = min(case.body[key], 4)
        status = call(case)
        seen[status] = seen.get(status, 0) + 1

    try:
        check()
    except hypothesis.errors.Unsatisfiable:  # no parameter to make invalid
        assert not valid, operation.path


def test_schemathesis_finds_no_5xx_and_no_schema_violation(server, model):
    """A bounded schemathesis run (:func:`_fuzz`, schema-valid and schema-invalid cases of
    every operation): no 5xx, and every response's status, content type and body as
    /openapi.json declares them."""
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import (
        content_type_conformance,
        response_schema_conformance,
        status_code_conformance,
    )

    auth = {"Authorization": f"Bearer {API_KEY}"}
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json", headers=auth)
    checks = [not_a_server_error, status_code_conformance, content_type_conformance,
              response_schema_conformance]

    def call(case) -> int:
        response = case.call(base_url=server.base_url, headers=auth, timeout=60)
        case.validate_response(response, checks=checks, headers=auth)
        return response.status_code

    seen: dict[int, int] = {}  # status code -> responses
    for result in schema.get_all_operations():
        operation = result.ok()
        if operation.path != "/metrics":
            for valid in (True, False):
                _fuzz(operation, valid, call, seen, model)
    assert seen.get(200, 0) >= 5 and seen.get(400, 0) >= 50, seen  # both kinds exercised
