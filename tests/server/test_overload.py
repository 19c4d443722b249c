"""Admission control (issue 28): with ``--max-waiting-requests``, requests beyond the
engine's seats and that many waiting get a 503 ``overloaded`` with ``Retry-After`` (529
``overloaded_error`` on /v1/messages) at once, and every accepted request is served whole."""

import os
import signal
import threading
import time

import anthropic
import httpx
import openai
import pytest
from server_testlib import A, engine_processes


@pytest.fixture(scope="module")
def small_server(scripted_model_dir):
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    srv = start_server(EngineConfig(model=str(scripted_model_dir), max_num_seqs=1),
                       timeout=300, max_waiting_requests=1)
    yield srv
    srv.stop()


def test_past_seats_and_queue_new_requests_get_503_then_all_accepted_are_served(small_server):
    """One seat, one may wait: with the engine frozen (SIGSTOP) holding two accepted
    requests, a third is refused at once; once it runs again both accepted ones finish."""
    url = small_server.base_url
    (engine,) = [p.pid for p in engine_processes(small_server)]
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    body = {"model": model, "prompt": [A], "max_tokens": 200, "ignore_eos": True}
    lengths = []

    def accepted():
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        lengths.append(r.json()["usage"]["completion_tokens"])

    os.kill(engine, signal.SIGSTOP)
    try:
        threads = [threading.Thread(target=accepted) for _ in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while httpx.get(f"{url}/health").json()["running"] < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        with pytest.raises(openai.APIStatusError) as info:
            client.completions.create(model=model, prompt=[A], max_tokens=2)
        assert info.value.status_code == 503 and info.value.body["code"] == "overloaded"
        assert info.value.response.headers["retry-after"] == "1"
        claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
        with pytest.raises(anthropic.APIStatusError) as info:
            claude.messages.create(model=model, max_tokens=2,
                                   messages=[{"role": "user", "content": "hi"}])
        assert info.value.status_code == 529
        assert info.value.body["error"]["type"] == "overloaded_error"
    finally:
        os.kill(engine, signal.SIGCONT)
    for t in threads:
        t.join(120)
    assert lengths == [200, 200]  # every accepted request served whole
    ok = client.completions.create(model=model, prompt=[A], max_tokens=2)
    assert ok.usage.completion_tokens == 2
