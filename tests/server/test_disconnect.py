"""A client that goes away mid-generation gets its request aborted in the engine."""

import time

import httpx


def _health(http) -> dict:
    return http.get("/health").json()


def _wait_idle(http, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        health = _health(http)
        if health["running"] == 0:
            return health
        time.sleep(0.05)
    raise AssertionError(f"requests still running: {health}")


LONG = {"prompt": "Count:", "max_tokens": 250, "ignore_eos": True, "temperature": 0}


def test_streaming_client_disconnect_aborts_the_request(server, http):
    before = _wait_idle(http)["aborts_sent"]
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # generation has started; now hang up
    after = _wait_idle(http)
    assert after["aborts_sent"] > before
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_non_streaming_client_disconnect_aborts_the_request(server, http):
    before = _wait_idle(http)["aborts_sent"]
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(60, read=0.3)) as c:
        try:
            c.post("/v1/completions", json=LONG)
        except httpx.ReadTimeout:
            pass  # the client gave up and closed the connection
    after = _wait_idle(http)
    assert after["aborts_sent"] > before
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_health_reports_ok(http):
    assert _health(http)["status"] == "ok"
