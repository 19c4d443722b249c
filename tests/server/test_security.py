"""API key, body size limit, and per-request limits."""

import httpx
import openai
import pytest
from server_testlib import API_KEY


def test_openai_client_without_the_key_gets_401(server, model):
    bad = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        bad.completions.create(model=model, prompt="hi", max_tokens=1)
    assert info.value.body["code"] == "invalid_api_key"


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer nope"},
                                     {"Authorization": API_KEY}, {"x-api-key": "nope"}],
                         ids=["none", "wrong-bearer", "no-bearer-prefix", "wrong-x-api-key"])
def test_api_routes_refuse_missing_or_wrong_keys(server, headers):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"),
                         ("POST", "/tokenize"), ("POST", "/detokenize")):
        r = httpx.request(method, f"{server.base_url}{path}", headers=headers,
                          json={"prompt": "hi", "tokens": [1]})
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"


def test_x_api_key_works_on_openai_routes_too(server):
    r = httpx.get(f"{server.base_url}/v1/models", headers={"x-api-key": API_KEY})
    assert r.status_code == 200


def test_docs_and_schema_need_the_key(server):
    """The interactive docs and the OpenAPI schema list every route: behind the key."""
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(f"{server.base_url}{path}").status_code == 401, path
        ok = httpx.get(f"{server.base_url}{path}", headers={"x-api-key": API_KEY})
        assert ok.status_code == 200, path


def test_health_version_and_metrics_need_no_key(server):
    for path in ("/health", "/version", "/metrics"):
        assert httpx.get(f"{server.base_url}{path}").status_code == 200, path


def test_body_over_the_limit_is_413_before_it_is_parsed(http):
    big = b'{"prompt": "' + b"a" * (16 * 1024 * 1024) + b'", "max_tokens": 1}'
    r = http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large"


def test_chunked_body_over_the_limit_is_413(http):
    def chunks():
        yield b'{"prompt": "'
        for _ in range(17):
            yield b"a" * (1024 * 1024)
        yield b'", "max_tokens": 1}'

    r = http.post("/v1/completions", content=chunks(),
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert "limit" in r.json()["error"]["message"]
    assert r.json()["error"]["code"] == "request_too_large"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_a_compressed_body_is_415_not_read_as_json(http, path):
    """A gzip body is refused by its Content-Encoding (in the route's protocol), not parsed
    as JSON and called malformed; an identity encoding is served."""
    import gzip

    raw = b'{"model": "m", "prompt": "hi", "max_tokens": 1}'
    r = http.post(path, content=gzip.compress(raw),
                  headers={"Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status_code == 415, r.text
    body = r.json()
    message = body["error"]["message"]
    assert message.startswith("Content-Encoding 'gzip' is not supported"), body
    if path == "/v1/messages":
        assert body["type"] == "error"
    else:
        assert body["error"]["code"] == "unsupported_content_encoding"
    r = http.post("/v1/completions", content=raw,
                  headers={"Content-Type": "application/json", "Content-Encoding": "identity"})
    assert r.status_code != 415


def test_error_bodies_carry_no_traceback(http):
    r = http.post("/v1/completions", content=b'{"prompt": [1, "x"]}',
                  headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "Traceback" not in r.text and 'File "' not in r.text


def test_cors_preflight_and_responses_with_vllms_defaults(server):
    """A browser's preflight (OPTIONS, no key) is answered, and responses carry the CORS
    header, with vLLM's defaults (every origin, method and header)."""
    origin = {"Origin": "http://page.example"}
    pre = httpx.options(f"{server.base_url}/v1/chat/completions", headers={
        **origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert pre.status_code == 200, pre.text
    assert pre.headers["access-control-allow-origin"] == "*"
    r = httpx.get(f"{server.base_url}/v1/models", headers={**origin, "x-api-key": API_KEY})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"


def test_cors_origins_can_be_restricted(smollm2_tokenizer):
    from fastapi.testclient import TestClient

    from latentserve.server.app import create_app
    from latentserve.server.state import ServerState

    class Idle:  # an engine client that is never asked for anything here
        dead_reason = last_stats = last_stats_at = None
        num_running = num_aborts_sent = 0

        async def start(self):
            pass

        async def close(self):
            pass

    cors = {"allow_origins": ["http://ok.example"], "allow_methods": ["*"],
            "allow_headers": ["*"], "allow_credentials": False}
    app = create_app(ServerState(Idle(), smollm2_tokenizer, "m", 256, 49152), cors=cors)
    with TestClient(app) as client:
        for origin, allowed in (("http://ok.example", True), ("http://other.example", False)):
            pre = client.options("/v1/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST"})
            assert (pre.headers.get("access-control-allow-origin") == origin) is allowed


def test_serve_flags_reach_the_cors_options():
    import argparse

    from latentserve.options import add_options, options_of
    from latentserve.server.options import ServerOptions

    p = argparse.ArgumentParser()
    add_options(p, ServerOptions)
    args = p.parse_args(["--allowed-origins", '["http://a.example"]', "--allow-credentials"])
    assert options_of(ServerOptions, args).cors == {
        "allow_origins": ["http://a.example"], "allow_methods": ["*"], "allow_headers": ["*"],
        "allow_credentials": True}
