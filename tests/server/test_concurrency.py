"""Many clients at once: shared prefixes with cancellations, a 64-client load with random
disconnects, and clients reusing one request id. Every survivor must get exactly what it
gets alone, and every KV slot must come back."""

import asyncio
import json
import random

import httpx
from server_testlib import API_KEY, assert_slots_invariant, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}


async def _stream(c: httpx.AsyncClient, body: dict, cancel_after: int | None = None,
                  headers: dict | None = None) -> dict:
    """Stream a completion; hang up after ``cancel_after`` text chunks. Returns the text,
    finish reasons, usage and the response id."""
    text, reasons, usage, rid, seen = "", [], None, None, 0
    async with c.stream("POST", "/v1/completions", json={**body, "stream": True},
                        headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            rid = chunk["id"]
            usage = chunk.get("usage") or usage
            for choice in chunk["choices"]:
                text += choice["text"]
                seen += 1
                if choice["finish_reason"]:
                    reasons.append(choice["finish_reason"])
            if cancel_after is not None and seen >= cancel_after:
                return {"cancelled": True}
    return {"text": text, "reasons": reasons, "usage": usage, "id": rid}


def _run(coro):
    return asyncio.run(coro)


def _client(server, limit: int = 64) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120,
                             limits=httpx.Limits(max_connections=limit,
                                                 max_keepalive_connections=limit))


def test_shared_prefix_with_cancellations_gives_survivors_their_solo_greedy_output(
        server, http):
    rng = random.Random(1)
    prefix = [rng.randrange(100, 40000) for _ in range(150)]  # a fresh, cold prefix
    bodies = [{"prompt": prefix + [rng.randrange(100, 40000) for _ in range(3)],
               "max_tokens": 10, "temperature": 0, "ignore_eos": True,
               "stream_options": {"include_usage": True}} for _ in range(16)]
    cancelled = {1, 4, 7, 10, 13}

    async def together():
        async with _client(server) as c:
            return await asyncio.gather(*[
                _stream(c, b, cancel_after=2 if i in cancelled else None)
                for i, b in enumerate(bodies)])

    results = _run(together())
    assert_slots_invariant(wait_idle(http))
    for i, (body, result) in enumerate(zip(bodies, results)):
        if i in cancelled:
            assert result == {"cancelled": True}
            continue
        plain = {k: v for k, v in body.items() if k != "stream_options"}  # not streamed
        solo = http.post("/v1/completions", json=plain).json()["choices"][0]["text"]
        assert result["text"] == solo, i
        assert result["reasons"] == ["length"] and result["usage"]["completion_tokens"] == 10


def test_64_streaming_clients_with_random_disconnects(server, http):
    rng = random.Random(2)
    jobs = []
    for _ in range(64):
        body = {"prompt": [rng.randrange(100, 40000) for _ in range(rng.randrange(3, 60))],
                "max_tokens": rng.randrange(1, 24), "temperature": rng.choice([0, 0.8]),
                "ignore_eos": True, "stream_options": {"include_usage": True}}
        cancel = rng.randrange(1, 4) if rng.random() < 0.3 else None
        jobs.append((body, cancel))

    async def load():
        async with _client(server) as c:
            return await asyncio.gather(*[_stream(c, b, cancel) for b, cancel in jobs])

    results = _run(load())
    completed = 0
    for (body, _), result in zip(jobs, results):
        if result.get("cancelled"):
            continue
        completed += 1
        assert result["reasons"] == ["length"]
        assert result["usage"]["completion_tokens"] == body["max_tokens"]
    assert completed >= 40
    health = wait_idle(http)
    assert health["status"] == "ok"
    assert_slots_invariant(health)
    after = http.post("/v1/completions", json={"prompt": "still there?", "max_tokens": 3,
                                               "ignore_eos": True})
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3


def test_two_requests_with_the_same_id_both_get_their_own_output(server, http):
    bodies = [{"prompt": p, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
              for p in ("First prompt here", "A different one")]
    solo = [http.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]

    async def both():
        async with _client(server) as c:
            return await asyncio.gather(*[
                _stream(c, b, headers={**AUTH, "X-Request-Id": "same-id"}) for b in bodies])

    results = _run(both())
    assert [r["text"] for r in results] == solo
    assert [r["id"] for r in results] == ["same-id", "same-id"]
    assert_slots_invariant(wait_idle(http))


def test_x_request_id_is_echoed_on_every_response(server, http):
    """Streamed, plain, an error, and a 401: the sanitized X-Request-Id comes back as a
    header (and is the completion's id)."""
    given, want = "trace 42/a" + "x" * 200, ("trace_42_a" + "x" * 200)[:128]
    body = {"model": http.get("/v1/models").json()["data"][0]["id"], "prompt": "w5",
            "max_tokens": 2}
    r = http.post("/v1/completions", json=body, headers={"X-Request-Id": given})
    assert r.status_code == 200 and r.headers["x-request-id"] == want
    assert r.json()["id"] == want
    with http.stream("POST", "/v1/completions", json={**body, "stream": True},
                     headers={"X-Request-Id": "s1"}) as s:
        assert s.headers["x-request-id"] == "s1"
        assert any(line.startswith("data: [DONE]") for line in s.iter_lines())
    bad = http.post("/v1/completions", json={**body, "max_tokens": -1},
                    headers={"X-Request-Id": "e1"})
    assert bad.status_code == 400 and bad.headers["x-request-id"] == "e1"
    unauth = httpx.post(f"{server.base_url}/v1/completions", json=body,
                        headers={"X-Request-Id": "u1"}, timeout=30)
    assert unauth.status_code == 401 and unauth.headers["x-request-id"] == "u1"
    assert "x-request-id" not in http.post("/v1/completions", json=body).headers
