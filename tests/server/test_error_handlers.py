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


@pytest.mark.parametrize("body, message", [
    ({"stop": [1, 2]}, "Invalid type for 'stop': expected a string or a list of strings "
                       "(got [1, 2])"),
    ({"stop": 5}, "Invalid type for 'stop': expected a string or a list of strings (got 5)"),
    ({"prompt": [1.5]}, "Invalid type for 'prompt': expected a string, a list of strings, a "
                        "list of integers or a list of lists of integers (got [1.5])"),
    ({"seed": "abc"}, "Invalid type for 'seed': Input should be a valid integer (got 'abc')"),
])
def test_a_union_field_names_every_type_it_takes(app_client, body, message):
    """A value no member of a union takes names the union's types (``stop`` takes a list of
    strings, so "should be a valid string" alone misled)."""
    r = app_client.post("/echo", json={"prompt": "x", **body})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == message


def test_messages_errors_name_the_field_as_anthropic_does():
    """Under /v1/messages a message that names its field another way reads ``field: reason``;
    the OpenAI shape keeps it as it is."""
    from latentserve.server.errors import APIError

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/messages")
    @app.post("/v1/completions")
    async def route(body: CompletionRequest):
        raise APIError("top_p must be in (0.0, 1.0], got 2.0", param="top_p")

    client = TestClient(app, raise_server_exceptions=False)
    for body, message in (({"prompt": "x"}, "top_p: must be in (0.0, 1.0], got 2.0"),
                          ({}, "prompt: Field required"),
                          ({"prompt": "x", "seed": "a"},
                           "seed: Input should be a valid integer (got 'a')")):
        r = client.post("/v1/messages", json=body)
        assert (r.status_code, r.json()["error"]["message"]) == (400, message)
    r = client.post("/v1/completions", json={"prompt": "x"})
    assert r.json()["error"]["message"] == "top_p must be in (0.0, 1.0], got 2.0"


@pytest.mark.parametrize("content", [b"{not json", b'{"prompt": "\xff"}', b"", b"[1]",
                                     b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
                                     b'{"prompt": "x", "seed": ' + b"1" * 5000 + b"}"],
                         ids=["syntax", "not-utf8", "empty", "not-an-object", "too-deep",
                              "too-many-digits"])
def test_a_body_that_is_not_a_json_object_is_invalid_json_on_both_apis(content):
    """OpenAI's body has ``code: "invalid_json"`` (never null) whatever the parser tripped
    on; Anthropic's the same message as an ``invalid_request_error``."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/completions")
    @app.post("/v1/messages")
    async def route(body: CompletionRequest):
        return {"ok": True}

    client = TestClient(app, raise_server_exceptions=False)
    headers = {"Content-Type": "application/json"}
    openai_error = client.post("/v1/completions", content=content, headers=headers)
    assert openai_error.status_code == 400
    error = openai_error.json()["error"]
    assert error["code"] == "invalid_json" and error["type"] == "invalid_request_error"
    assert "JSON" in error["message"]
    anthropic_error = client.post("/v1/messages", content=content, headers=headers)
    assert anthropic_error.status_code == 400
    assert anthropic_error.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": error["message"]}}
    if content.startswith(b'{"prompt": [['):
        assert error["message"] == ("Malformed JSON body: it nests too deeply (arrays or "
                                    "objects inside one another)")
    if b"1" * 5000 in content:  # over Python's int digit limit: said, not "ValueError"
        assert error["message"] == ("Malformed JSON body: a number in the body has too many "
                                    "digits (over 4300)")
