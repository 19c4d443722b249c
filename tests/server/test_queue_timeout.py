"""``--queue-timeout`` (issue 28): a request that waits longer than that for one of the
engine's seats is aborted and answered 503 ``overloaded`` with ``Retry-After`` (Anthropic's
529 ``overloaded_error`` on /v1/messages); every request that got a seat is served whole, and
no KV slot is lost."""

import os
import signal
import threading

import anthropic
import httpx
import openai
import pytest
from server_testlib import A, engine_processes, wait_idle

QUEUE_TIMEOUT_S = 1.0
MAX_TOKENS = 200


@pytest.fixture(scope="module")
def seat_server(scripted_model_dir):
    """One seat, no prefix cache (so the free slot count is exact), a 1 s queue timeout."""
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    srv = start_server(EngineConfig(model=str(scripted_model_dir), max_num_seqs=1,
                                    enable_prefix_caching=False),
                       timeout=300, queue_timeout=QUEUE_TIMEOUT_S)
    yield srv
    srv.stop()


def _model(url: str) -> str:
    return httpx.get(f"{url}/v1/models").json()["data"][0]["id"]


def test_requests_past_the_queue_timeout_get_503_and_the_rest_are_served_whole(seat_server):
    """12 concurrent requests of 200 tokens on one seat: the first is served at once, the
    last wait for the others' 11 x 200 decode steps (well past 1 s): those get the 503."""
    url = seat_server.base_url
    with httpx.Client(base_url=url, timeout=120) as http:
        free = wait_idle(http)["kv_slots_free"]
    body = {"model": _model(url), "prompt": [A], "max_tokens": MAX_TOKENS, "ignore_eos": True}
    results = []

    def one():
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
        results.append((r.status_code, r.headers.get("retry-after"), r.json()))

    threads = [threading.Thread(target=one) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    served = [b for s, _, b in results if s == 200]
    refused = [(h, b) for s, h, b in results if s == 503]
    assert len(served) + len(refused) == 12
    assert served and refused
    assert all(b["usage"]["completion_tokens"] == MAX_TOKENS for b in served)
    for retry_after, b in refused:
        assert retry_after == "1" and b["error"]["code"] == "overloaded"
        assert "--queue-timeout" in b["error"]["message"]
    with httpx.Client(base_url=url, timeout=120) as http:
        assert wait_idle(http)["kv_slots_free"] == free  # aborted waiters held nothing


def test_queue_timeout_is_a_503_on_openai_and_a_529_on_anthropic(seat_server):
    """With the engine frozen (SIGSTOP) nothing is scheduled: each request times out after
    1 s with its protocol's overload error, and the engine's slots are all free after."""
    url = seat_server.base_url
    model = _model(url)
    with httpx.Client(base_url=url, timeout=120) as http:
        free = wait_idle(http)["kv_slots_free"]
    (engine,) = [p.pid for p in engine_processes(seat_server)]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0)
    os.kill(engine, signal.SIGSTOP)
    try:
        with pytest.raises(openai.APIStatusError) as info:
            client.chat.completions.create(model=model, max_tokens=2, stream=True,
                                           messages=[{"role": "user", "content": "hi"}])
        assert info.value.status_code == 503 and info.value.body["code"] == "overloaded"
        assert info.value.response.headers["retry-after"] == "1"
        with pytest.raises(anthropic.APIStatusError) as info:
            claude.messages.create(model=model, max_tokens=2,
                                   messages=[{"role": "user", "content": "hi"}])
        assert info.value.status_code == 529
        assert info.value.body["error"]["type"] == "overloaded_error"
    finally:
        os.kill(engine, signal.SIGCONT)
    with httpx.Client(base_url=url, timeout=120) as http:
        assert wait_idle(http)["kv_slots_free"] == free
    ok = client.completions.create(model=model, prompt=[A], max_tokens=2)
    assert ok.usage.completion_tokens == 2


def test_a_request_seated_before_its_first_output_does_not_time_out():
    """The engine says a request is scheduled (a first prefill chunk: no output yet) before
    the queue timeout; its first output comes after it. The wait for a seat ended when it
    was seated, so the output is delivered, not an ``EngineQueueTimeout``."""
    import asyncio

    from latentserve.outputs import StepOutput
    from latentserve.sampling_params import SamplingParams
    from latentserve.server.client import EngineClient
    from latentserve.server.messages import StepOutputs

    client = EngineClient("ipc://unused-in", "ipc://unused-out")
    client._push = type("Push", (), {"send_pyobj": lambda self, msg: None})()

    async def main():
        async def engine():
            await asyncio.sleep(0.05)
            client._dispatch(StepOutputs([], {"r": (0.0, 0.0)}))
            await asyncio.sleep(0.4)  # past the 0.2 s queue timeout
            client._dispatch(StepOutputs([StepOutput("r", [7], True, "length")]))

        task = asyncio.create_task(engine())
        outs = [o async for o in client.generate("r", [1, 2], SamplingParams(), 0.2)]
        await task
        return outs

    (out,) = asyncio.run(main())
    assert out.new_token_ids == [7] and out.finished and client.num_running == 0
