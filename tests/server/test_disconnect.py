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
    before = wait_idle(http)["aborts_sent"]
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(60, read=0.3),
                      headers=AUTH) as c:
        try:
            c.post("/v1/completions", json=LONG)
        except httpx.ReadTimeout:
            pass  # the client gave up and closed the connection
    after = wait_idle(http)
    assert after["aborts_sent"] > before
    assert http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2}).status_code == 200


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
