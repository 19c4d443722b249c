"""A client that goes away mid-generation gets its requests aborted in the engine, and every
KV slot comes back."""

import httpx
from server_testlib import API_KEY, assert_slots_invariant, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
LONG = {"prompt": "Count:", "max_tokens": 250, "ignore_eos": True, "temperature": 0}


def test_streaming_client_disconnect_aborts_the_request(server, http):
    before = wait_idle(http)["aborts_sent"]
    with httpx.Client(base_url=server.base_url, timeout=60, headers=AUTH) as c:
        with c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # generation has started; now hang up
    after = wait_idle(http)
    assert after["aborts_sent"] > before
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_non_streaming_client_disconnect_aborts_the_request(server, http):
    """The client hangs up 0.1 s in (LONG takes 0.25-0.5 s on a 2-core CPU; at 0.3 s a warm
    server had already answered): the request stops early, aborted in the engine, or never
    started where the server noticed before it reached the engine (a loaded machine)."""
    health = wait_idle(http)
    before, tokens = health["aborts_sent"], health["engine"]["num_forward_tokens"]
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(60, read=0.1),
                      headers=AUTH) as c:
        try:
            c.post("/v1/completions", json=LONG)
        except httpx.ReadTimeout:
            pass  # the client gave up and closed the connection
    after = wait_idle(http)
    ran = after["engine"]["num_forward_tokens"] - tokens
    assert ran < LONG["max_tokens"]
    assert ran == 0 or after["aborts_sent"] > before
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_client_that_hangs_up_right_after_sending_leaves_nothing_running(server, http):
    """The disconnect can be noticed before the request reaches the engine: the request must
    not start afterwards and run to max_tokens (counted in the engine's forward tokens)."""
    import json
    import socket
    from urllib.parse import urlparse

    url = urlparse(server.base_url)
    body = json.dumps(LONG).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\n"
            f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    before = wait_idle(http)["engine"]["num_forward_tokens"]
    for _ in range(3):
        with socket.create_connection((url.hostname, url.port)) as sock:
            sock.sendall(head + body)
    after = wait_idle(http, timeout=20)
    assert_slots_invariant(after)
    # Each of the 3 would decode 250 tokens if it ran; aborted early, none gets that far.
    assert after["engine"]["num_forward_tokens"] - before < LONG["max_tokens"]


def test_n2_stream_disconnect_aborts_both_choices_and_frees_every_slot(server, http):
    before = wait_idle(http)["aborts_sent"]
    body = {"messages": [{"role": "user", "content": "Count to a thousand."}], "n": 2,
            "max_tokens": 200, "ignore_eos": True, "temperature": 0, "stream": True}
    with httpx.Client(base_url=server.base_url, timeout=60, headers=AUTH) as c:
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            indices = set()
            while len(indices) < 2:  # both choices are generating
                line = next(lines)
                if line.startswith("data: {") and '"content":""' not in line:
                    indices.add(line.split('"index":')[1][0])
    after = wait_idle(http)
    assert after["aborts_sent"] - before == 2
    assert_slots_invariant(after)


def test_a_stream_aborted_before_its_first_output_is_aborted_once(monkeypatch):
    """A client that leaves while its stream waits for the first output (queued) gets one
    abort per engine request, not a second one from the watcher of the stream's body (the
    count behind ``/health``'s ``aborts_sent``)."""
    import asyncio
    from types import SimpleNamespace

    from latentserve.server import serving
    from latentserve.server.generation import TextDelta

    aborted: list[str] = []

    async def receive():
        await asyncio.sleep(0)
        return {"type": "http.disconnect"}

    async def deltas(state, reqs, arrival, ticket):
        await asyncio.sleep(0.05)  # queued: the watcher sees the disconnect first
        yield 0, TextDelta("", "abort", 0, [])

    async def chunks(items):
        async for _, delta in items:
            await asyncio.sleep(0.05)  # the body's own watcher runs meanwhile
            yield {"finish_reason": delta.finish_reason}

    async def main():
        monkeypatch.setattr(serving, "_deltas", deltas)
        state = SimpleNamespace(client=SimpleNamespace(abort=aborted.append))
        reqs = [SimpleNamespace(rid="r-0")]
        response = await serving.stream(SimpleNamespace(receive=receive), state, reqs, None,
                                        None, chunks)
        return [part async for part in response.body_iterator]

    body = asyncio.run(main())
    assert aborted == ["r-0"] and body[-1] == "data: [DONE]\n\n"
