"""Admission control (issue 28): with ``--max-waiting-requests``, requests beyond the
engine's seats and that many waiting get a 503 ``overloaded`` with ``Retry-After`` (529
``overloaded_error`` on /v1/messages) at once, counted in the API process as they arrive (a
burst cannot slip past the bound), and every accepted request is served whole."""

import os
import signal
import threading
import time

import anthropic
import httpx
import openai
import pytest
from server_testlib import A, engine_processes

SEATS, MAY_WAIT, BURST = 1, 3, 12
REFUSAL_S = 0.1  # a refusal answers at once: no tokenizing, no engine


@pytest.fixture(scope="module")
def small_server(scripted_model_dir):
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    srv = start_server(EngineConfig(model=str(scripted_model_dir), max_num_seqs=SEATS),
                       timeout=300, max_waiting_requests=MAY_WAIT)
    yield srv
    srv.stop()


def test_a_burst_past_seats_and_queue_is_refused_at_once_and_accepted_ones_are_served(
        small_server):
    """One seat, three may wait: a burst of twelve requests at an engine frozen by SIGSTOP
    (nothing is scheduled, so no count can come from the engine) has exactly four accepted
    and eight refused, each refusal answered while the engine is still frozen and within
    ``REFUSAL_S``; once the engine runs again the four finish whole."""
    url = small_server.base_url
    (engine,) = engine_processes(small_server)
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": [A], "max_tokens": 200, "ignore_eos": True}
    httpx.post(f"{url}/v1/completions", json={**body, "max_tokens": 1}, timeout=60)  # warm
    results, go = [], threading.Barrier(BURST)

    def send():
        with httpx.Client(timeout=120) as c:
            go.wait(30)
            t0 = time.monotonic()
            r = c.post(f"{url}/v1/completions", json=body)
            results.append((r, time.monotonic() - t0, engine.status()))

    os.kill(engine.pid, signal.SIGSTOP)
    try:
        threads = [threading.Thread(target=send) for _ in range(BURST)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while len(results) < BURST - SEATS - MAY_WAIT:
            assert time.monotonic() < deadline, [r.status_code for r, *_ in results]
            time.sleep(0.02)
        time.sleep(0.5)  # a request accepted past the bound would be counted here
        refused = list(results)  # the accepted ones wait for the frozen engine
        assert len(refused) == BURST - SEATS - MAY_WAIT
        for r, _, status in refused:
            assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
            assert r.headers["retry-after"] == "1"
            assert status == "stopped"  # answered without the engine
        waits = sorted(s for _, s, _ in refused)
        assert waits[len(waits) // 2] < REFUSAL_S, waits
        # One request at a time, after the burst: each refusal is immediate.
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        for _ in range(3):
            t0 = time.monotonic()
            with pytest.raises(openai.APIStatusError) as info:
                client.completions.create(model=model, prompt=[A], max_tokens=2)
            assert time.monotonic() - t0 < REFUSAL_S
            assert info.value.status_code == 503 and info.value.body["code"] == "overloaded"
        claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as info:
            claude.messages.create(model=model, max_tokens=2,
                                   messages=[{"role": "user", "content": "hi"}])
        assert info.value.status_code == 529
        assert info.value.body["error"]["type"] == "overloaded_error"
        assert info.value.response.headers["retry-after"] == "1"
    finally:
        os.kill(engine.pid, signal.SIGCONT)
    for t in threads:
        t.join(120)
    accepted = [r.json() for r, *_ in results if r.status_code == 200]
    assert [a["usage"]["completion_tokens"] for a in accepted] == [200] * (SEATS + MAY_WAIT)
    assert len(results) == BURST
    ok = client.completions.create(model=model, prompt=[A], max_tokens=2)
    assert ok.usage.completion_tokens == 2
    assert httpx.get(f"{url}/health").json()["running"] == 0
