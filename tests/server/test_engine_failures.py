"""An exception inside one request fails that request (a 500-class error) and the engine
keeps serving the others. Faults are injected in-process: into the sampler, into the
forward, and (for the HTTP mapping) into a stand-in engine client."""

import json
import pickle

import pytest
from server_testlib import StandInClient

from latentserve.config import EngineConfig
from latentserve.outputs import StepOutput
from latentserve.sampling_params import SamplingParams
from latentserve.server.engine_process import MAX_CONSECUTIVE_STEP_FAILURES, EngineLoop
from latentserve.server.messages import EngineFailed, RequestFailed, StepOutputs

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from latentserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_model_dir), max_num_seqs=4))


def _drain(engine) -> list[StepOutput]:
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    return outs


def _tokens(outs, rid):
    return [t for o in outs if o.rid == rid for t in o.new_token_ids]


def _idle_invariant(engine):
    s = engine.stats()
    assert s["num_running"] == s["num_waiting"] == 0
    assert s["kv_slots_free"] + s["kv_slots_cached"] == s["kv_slots_total"]


def test_sampler_failure_fails_only_its_request(engine, monkeypatch):
    import latentserve.sampling as sampling

    engine.add_request("solo", PROMPT, GREEDY)
    expected = _tokens(_drain(engine), "solo")
    real = sampling.sample_with_logprobs

    def faulty(logits, reqs, generator=None, **kw):
        if any(r.rid == "poison" for r in reqs):
            raise RuntimeError("injected sampler fault")
        return real(logits, reqs, generator, **kw)

    monkeypatch.setattr(sampling, "sample_with_logprobs", faulty)
    engine.add_request("good", PROMPT, GREEDY)
    engine.add_request("poison", [9, 10, 11], GREEDY)
    outs = _drain(engine)
    poison = [o for o in outs if o.rid == "poison"]
    assert [o.finish_reason for o in poison] == ["error"]
    assert "sampling failed" in poison[0].error and "injected" not in poison[0].error
    assert _tokens(outs, "good") == expected
    _idle_invariant(engine)


class _Outbox:
    def __init__(self):
        self.messages = []

    def send_pyobj(self, message):
        self.messages.append(pickle.loads(pickle.dumps(message)))


def _loop(engine):
    return EngineLoop(engine, inbox=None, outbox=_Outbox())


def test_forward_failure_fails_the_running_requests_and_the_loop_goes_on(engine,
                                                                         monkeypatch):
    from latentserve.server.messages import AddRequest

    real = engine.runner.run
    calls = {"n": 0}

    def faulty(batch):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected forward fault")
        return real(batch)

    monkeypatch.setattr(engine.runner, "run", faulty)
    loop = _loop(engine)
    loop.handle(AddRequest("doomed", PROMPT, GREEDY))
    loop._step()
    assert loop.outbox.messages == [RequestFailed(
        "doomed", "the engine failed while running this request (RuntimeError)", True)]
    loop.handle(AddRequest("after", PROMPT, GREEDY))
    while engine.has_unfinished_requests():
        loop._step()
    outs = [o for m in loop.outbox.messages if isinstance(m, StepOutputs) for o in m.outputs]
    assert len(_tokens(outs, "after")) == 6 and outs[-1].finish_reason == "length"
    assert {o.rid for o in outs} <= {"doomed", "after"}  # "doomed" may only say "abort"
    _idle_invariant(engine)


def test_repeated_forward_failures_end_the_engine(engine, monkeypatch):
    from latentserve.server.messages import AddRequest

    def broken(batch):
        raise RuntimeError("the model is broken")

    monkeypatch.setattr(engine.runner, "run", broken)
    loop = _loop(engine)
    with pytest.raises(RuntimeError, match="broken"):
        for i in range(MAX_CONSECUTIVE_STEP_FAILURES):
            loop.handle(AddRequest(f"r{i}", PROMPT, GREEDY))
            loop._step()
    assert isinstance(loop.outbox.messages[-1], EngineFailed)
    monkeypatch.undo()
    _drain(engine)


# --- the HTTP mapping, with a stand-in engine client ---------------------------------------


class _FailingClient(StandInClient):
    """Generates one token, then fails the way the engine reports an internal error."""

    async def generate(self, rid, prompt_ids, params):
        from latentserve.server.client import EngineInternalError

        yield StepOutput(rid, [28])
        raise EngineInternalError("the engine failed while running this request")


@pytest.fixture
def failing_app(smollm2_tokenizer):
    from fastapi.testclient import TestClient

    from latentserve.server.app import create_app
    from latentserve.server.state import ServerState

    state = ServerState(_FailingClient(), smollm2_tokenizer, "m", 256, 49152)
    with TestClient(create_app(state), raise_server_exceptions=False) as c:
        yield c


def test_engine_failure_is_a_500_body_without_traceback(failing_app):
    r = failing_app.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
    assert r.status_code == 500
    assert r.json()["error"]["type"] == "server_error"
    assert r.json()["error"]["code"] == "engine_error"
    assert "Traceback" not in r.text


def test_engine_failure_mid_stream_ends_with_an_error_event(failing_app):
    r = failing_app.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True})
    events = [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]
    assert r.status_code == 200 and events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["type"] == "server_error"


def test_engine_failure_on_messages_is_an_anthropic_api_error(failing_app):
    r = failing_app.post("/v1/messages", json={
        "model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 500
    assert r.json() == {"type": "error", "error": {
        "type": "api_error", "message": "the engine failed while running this request"}}


class _DyingClient(_FailingClient):
    """Generates one token, then reports the engine process gone."""

    async def generate(self, rid, prompt_ids, params):
        from latentserve.server.client import EngineDeadError

        yield StepOutput(rid, [28])
        raise EngineDeadError("the engine process has stopped")


def test_engine_death_mid_stream_on_messages_is_an_api_error_event(smollm2_tokenizer):
    """A dead engine is a server fault: Anthropic's ``api_error`` (503 when no stream has
    started), not ``overloaded_error``, which is kept for load shedding (529)."""
    from fastapi.testclient import TestClient

    from latentserve.server.app import create_app
    from latentserve.server.state import ServerState

    state = ServerState(_DyingClient(), smollm2_tokenizer, "m", 256, 49152)
    body = {"model": "m", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
    with TestClient(create_app(state), raise_server_exceptions=False) as app:
        r = app.post("/v1/messages", json={**body, "stream": True})
        assert r.status_code == 200
        lines = r.text.splitlines()
        assert lines[-3] == "event: error", lines[-4:]
        assert json.loads(lines[-2][6:]) == {"type": "error", "error": {
            "type": "api_error", "message": "the engine process has stopped"}}
        state.client.dead_reason = "the engine process has stopped"

        async def dead(rid, prompt_ids, params):
            from latentserve.server.client import EngineDeadError

            raise EngineDeadError(state.client.dead_reason)
            yield

        state.client.generate = dead
        r = app.post("/v1/messages", json=body)
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "api_error"


class _MinusInfClient(_FailingClient):
    """One token whose logprob (and its top entry) is -inf."""

    async def generate(self, rid, prompt_ids, params):
        from latentserve.outputs import TokenLogprob

        inf = float("-inf")
        yield StepOutput(rid, [28], finished=True, finish_reason="length",
                         logprobs=[TokenLogprob(28, inf, 1, [(28, inf)])])


def test_minus_inf_logprobs_are_null_in_a_body(smollm2_tokenizer):
    """JSON has no -inf: a body writes null, as a stream chunk does."""
    from fastapi.testclient import TestClient

    from latentserve.server.app import create_app
    from latentserve.server.state import ServerState

    state = ServerState(_MinusInfClient(), smollm2_tokenizer, "m", 256, 49152)
    with TestClient(create_app(state), raise_server_exceptions=False) as app:
        r = app.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1, "logprobs": 1})
        assert r.status_code == 200
        lps = r.json()["choices"][0]["logprobs"]
        assert lps["token_logprobs"] == [None] and lps["top_logprobs"] == [{",": None}]
        r = app.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
            "logprobs": True, "top_logprobs": 1})
        assert r.status_code == 200
        entry = r.json()["choices"][0]["logprobs"]["content"][0]
        assert entry["logprob"] is None and entry["top_logprobs"][0]["logprob"] is None
