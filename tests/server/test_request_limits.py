"""The cap on one request's total work, and how refusals are counted, on an in-process app
whose engine client is a stand-in (no model runs: these are checks of the API process)."""

import re

import pytest
from server_testlib import StandInClient

from latentserve.outputs import StepOutput


class _StandInClient(StandInClient):
    """Records every engine request; answers each with one token and ``length``, or raises
    ``refuse`` (an ``EngineRequestError``) as the engine does for a request it rejects."""

    def __init__(self, refuse: str | None = None):
        self.refuse = refuse
        self.sent: list = []

    async def generate(self, rid, prompt_ids, params):
        from latentserve.server.client import EngineRequestError

        self.sent.append(params)
        if self.refuse is not None:
            raise EngineRequestError(self.refuse)
        yield StepOutput(rid, [28], True, "length")


def _app(tokenizer, client, **limits):
    from fastapi.testclient import TestClient

    from latentserve.server.app import create_app
    from latentserve.server.state import ServerLimits, ServerState

    state = ServerState(client, tokenizer, "m", 256, 49152, limits=ServerLimits(**limits))
    return TestClient(create_app(state), raise_server_exceptions=False)


def test_total_output_over_the_cap_is_a_400_naming_max_tokens(smollm2_tokenizer):
    client = _StandInClient()
    with _app(smollm2_tokenizer, client, max_request_output_tokens=100) as app:
        # 3 prompts x n=4 x max_tokens=10 = 120 > 100: refused before the engine sees it.
        r = app.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 4,
                                              "max_tokens": 10})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "max_tokens"
        assert "at most 100" in error["message"] and "got 120" in error["message"]
        assert client.sent == []
        # 2 prompts x 5 x 10 = 100: exactly at the cap is allowed.
        ok = app.post("/v1/completions", json={"prompt": ["a", "b"], "n": 5,
                                               "max_tokens": 10})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 10
        assert len(client.sent) == 10


def test_chat_cap_names_max_completion_tokens_and_counts_an_unset_max_tokens(
        smollm2_tokenizer):
    client = _StandInClient()
    messages = [{"role": "user", "content": "hi"}]
    with _app(smollm2_tokenizer, client, max_request_output_tokens=300) as app:
        r = app.post("/v1/chat/completions", json={"messages": messages, "n": 4,
                                                   "max_completion_tokens": 80})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_completion_tokens"
        # Unset max_tokens means "to the end of the 256-token context": 2 x ~240 > 300.
        r = app.post("/v1/chat/completions", json={"messages": messages, "n": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        assert client.sent == []


def test_limits_below_one_are_refused_by_name():
    from latentserve.server.state import ServerLimits

    with pytest.raises(ValueError, match="max_request_output_tokens must be >= 1"):
        ServerLimits(max_request_output_tokens=0)


def test_engine_context_refusal_is_a_400_and_not_an_error_in_metrics(smollm2_tokenizer):
    refusal = ("prompt has 20 tokens (+240 latent and transition) but max_model_len is 256; "
               "it must be shorter to leave room for at least one output token")
    with _app(smollm2_tokenizer, _StandInClient(refuse=refusal)) as app:
        for stream in (False, True):
            r = app.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2,
                                                  "stream": stream})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["code"] == "context_length_exceeded"
            assert r.json()["error"]["param"] == "prompt"
        metrics = app.get("/metrics").text
    finished = re.findall(r'^latentserve_request_success_total\{.*finished_reason="(\w+)".*\} '
                          r'([0-9.]+)$', metrics, re.M)
    assert all(float(count) == 0 for _, count in finished), finished
    assert 'finished_reason="error"' not in metrics


def test_more_stop_strings_than_the_limit_are_a_400_naming_the_field(smollm2_tokenizer):
    client = _StandInClient()
    with _app(smollm2_tokenizer, client, max_stop=3) as app:
        stops = ["x", "y", "z", "w"]
        for route, body, field in (
                ("/v1/completions", {"prompt": "a", "stop": stops}, "stop"),
                ("/v1/chat/completions",
                 {"messages": [{"role": "user", "content": "a"}], "stop": stops}, "stop")):
            r = app.post(route, json={"max_tokens": 2, **body})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == field
            assert "at most 3" in r.json()["error"]["message"]
        r = app.post("/v1/messages", json={"model": "m", "max_tokens": 2, "stop_sequences": stops,
                                           "messages": [{"role": "user", "content": "a"}]})
        assert r.status_code == 400 and "stop_sequences" in r.text, r.text
        assert client.sent == []
        ok = app.post("/v1/completions", json={"prompt": "a", "max_tokens": 2,
                                               "stop": stops[:3]})
        assert ok.status_code == 200 and len(client.sent) == 1
