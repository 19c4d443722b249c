"""The error handlers on their own (no engine): OpenAI body, field names, no stack traces."""

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from latentserve.server.errors import install_error_handlers, validation_error
from latentserve.server.protocol import CompletionRequest


@pytest.fixture
def app_client():
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/echo")
    async def echo(body: CompletionRequest):
        return {"ok": True}

    @app.get("/boom")
    async def boom():
        raise RuntimeError("secret internal detail")

    return TestClient(app, raise_server_exceptions=False)


def test_unexpected_exception_is_a_generic_500_without_trace(app_client):
    r = app_client.get("/boom")
    assert r.status_code == 500
    assert r.json() == {"error": {"message": "Internal server error", "type": "server_error",
                                  "param": None, "code": None}}
    assert "secret" not in r.text and "Traceback" not in r.text


def test_wrong_type_is_400_not_422(app_client):
    r = app_client.post("/echo", json={"prompt": "x", "seed": "abc"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "seed"


@pytest.mark.parametrize("loc,param", [
    (("body", "prompt", "list[int]", 1), "prompt"),
    (("body", "messages", 0, "content", "str"), "messages[0].content"),
    (("body", "stream_options", "include_usage"), "stream_options.include_usage"),
    (("body", "messages", 2, "content", "list[ContentPart]", 0, "ContentPart", "type"),
     "messages[2].content"),
])
def test_param_is_the_field_path_without_union_tags(loc, param):
    error = validation_error([{"loc": loc, "msg": "bad", "type": "x_type", "input": 1}])
    assert error.param == param and error.status_code == 400
