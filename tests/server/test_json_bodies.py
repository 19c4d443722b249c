"""A JSON body is read as JSON whatever its Content-Type (issue 28): curl ``-d`` sends
``application/x-www-form-urlencoded``, some SDKs ``text/plain`` or none; vLLM serves them.
A body that is not JSON is still a 400 in the route's error shape."""

import json

import pytest

GREEDY = {"max_tokens": 3, "temperature": 0, "ignore_eos": True}
BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Name a color."}],
                             **GREEDY},
    "/v1/completions": {"prompt": "Colors:", **GREEDY},
    # ignore_eos is not an Anthropic field (a 400 there): the answer may end early.
    "/v1/messages": {"model": None, "messages": [{"role": "user", "content": "Name a color."}],
                     "max_tokens": 3, "temperature": 0},
}


def _text(path: str, body: dict) -> str:
    if path == "/v1/messages":
        return body["content"][0]["text"]
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


@pytest.mark.parametrize("content_type", ["application/x-www-form-urlencoded",
                                          "text/plain; charset=utf-8", None])
@pytest.mark.parametrize("path", list(BODIES))
def test_json_body_without_json_content_type_is_served(http, model, path, content_type):
    body = {**BODIES[path], "model": model}
    as_json = http.post(path, json=body)
    headers = {} if content_type is None else {"Content-Type": content_type}
    r = http.post(path, content=json.dumps(body).encode(), headers=headers)
    assert r.request.headers.get("content-type") == content_type
    assert r.status_code == 200, r.text
    assert _text(path, r.json()) == _text(path, as_json.json())


def test_body_that_is_not_json_is_a_400_in_each_protocols_shape(http):
    r = http.post("/v1/chat/completions", content=b"messages=hi",
                  headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "invalid_json"
    r = http.post("/v1/messages", content=b"{not json", headers={"Content-Type": "text/plain"})
    assert r.status_code == 400
    assert r.json()["type"] == "error"
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert "JSON" in r.json()["error"]["message"]
