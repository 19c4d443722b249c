"""The public shape of a latent trace (docs/server.md, "Streamed latent steps";
server/latent_trace.py), on a tiny CoLaR whose stop fires: with ``stream_latent_steps`` each
latent step is one chunk whose ``latent`` is ``{"steps": k, "trace": [entry k]}`` on
/v1/completions and /v1/chat/completions; an entry holds the logit lens of the step's input
(``top_tokens``, ``top_probs``, ``top_texts``: each id decoded), its ``norm`` and the
``stop_prob`` read at its decision; the finish chunk's trace is those entries, and the
head's stats say where and why the phase ended. ``/v1/models`` says the family and its
controls."""

import json
import math

import httpx
import pytest
from server_testlib import API_KEY, COLAR_STOP_STEPS, COLAR_STOPS

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TRACED = {"return_latent_trace": True, "stream_latent_steps": True}


def _stream(srv, path: str, body: dict) -> list[dict]:
    """The choices of every chunk of a streamed request, in order."""
    choices = []
    with httpx.stream("POST", f"{srv.base_url}{path}", headers=AUTH, timeout=120,
                      json={"max_tokens": 3, "temperature": 0, "stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices += json.loads(line[6:])["choices"]
    return choices


def _ticks(choices: list[dict]) -> list[dict]:
    return [c["latent"] for c in choices if c.get("latent") and c["finish_reason"] is None]


def _final(choices: list[dict]) -> dict:
    return next(c for c in choices if c["finish_reason"] is not None)["latent"]


def _texts(srv, ids: list[int]) -> list[str]:
    """Each id decoded on its own by ``/detokenize``."""
    return [httpx.post(f"{srv.base_url}/detokenize", headers=AUTH, timeout=30,
                       json={"tokens": [t]}).json()["prompt"] for t in ids]


@pytest.fixture(scope="module")
def completion(colar_key_server):
    return _stream(colar_key_server, "/v1/completions", {"prompt": COLAR_STOPS, **TRACED})


def test_each_latent_step_is_one_completion_chunk_with_its_entry(completion):
    ticks = _ticks(completion)
    assert [t["steps"] for t in ticks] == list(range(1, COLAR_STOP_STEPS + 1))
    assert all(len(t["trace"]) == 1 for t in ticks)
    tick_chunks = [c for c in completion if c.get("latent") and c["finish_reason"] is None]
    assert all(c["text"] == "" for c in tick_chunks)
    final = _final(completion)
    assert final["steps"] == COLAR_STOP_STEPS
    assert final["trace"] == [t["trace"][0] for t in ticks]


def test_an_entry_has_the_lens_as_text_with_probabilities(colar_key_server, completion):
    for entry in _final(completion)["trace"]:
        ids = [t for t, _ in entry["top_tokens"]]
        assert len(ids) == 5 and entry["top_texts"] == _texts(colar_key_server, ids)
        probs = entry["top_probs"]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1
        # softmax: the ratio of two probabilities is the exp of their logits' difference
        (_, l0), (_, l1) = entry["top_tokens"][:2]
        assert math.isclose(probs[0] / probs[1], math.exp(l0 - l1), rel_tol=1e-4)
        assert entry["norm"] > 0 and 0 <= entry["stop_prob"] <= 1


def test_the_stats_say_where_and_why_the_phase_ended(completion):
    stats = _final(completion)["stats"]
    assert (stats["end"], stats["stop_step"], stats["steps"]) == ("stop", COLAR_STOP_STEPS,
                                                                  COLAR_STOP_STEPS)
    assert 0 < stats["end_stop_prob"] <= 1


def test_chat_ticks_pair_the_reasoning_line_with_the_entry(colar_key_server):
    choices = _stream(colar_key_server, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": COLAR_STOPS.removeprefix(
            "Question: ").removesuffix(" Let's think step by step:")}], **TRACED})
    ticks = [c for c in choices if c.get("latent") and c["finish_reason"] is None]
    assert [c["delta"]["reasoning_content"] for c in ticks] == [
        f"[step {k}]\n" for k in range(1, COLAR_STOP_STEPS + 1)]
    assert [c["latent"]["steps"] for c in ticks] == list(range(1, COLAR_STOP_STEPS + 1))
    assert all(len(c["latent"]["trace"][0]["top_texts"]) == 5 for c in ticks)


def test_ticks_without_a_trace_count_the_steps(colar_key_server):
    choices = _stream(colar_key_server, "/v1/completions",
                      {"prompt": COLAR_STOPS, "stream_latent_steps": True})
    ticks = _ticks(choices)
    assert [t["steps"] for t in ticks] == list(range(1, COLAR_STOP_STEPS + 1))
    assert all(t["trace"] is None for t in ticks)


def test_whole_response_trace_has_texts(colar_key_server):
    r = httpx.post(f"{colar_key_server.base_url}/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": COLAR_STOPS, "max_tokens": 2, "temperature": 0,
                         "return_latent_trace": True})
    assert r.status_code == 200, r.text
    trace = r.json()["choices"][0]["latent"]["trace"]
    assert len(trace) == COLAR_STOP_STEPS and all(len(e["top_texts"]) == 5 for e in trace)


def test_models_card_names_the_family_and_its_controls(colar_key_server):
    card = httpx.get(f"{colar_key_server.base_url}/v1/models", headers=AUTH,
                     timeout=30).json()["data"][0]
    assert card["latent"] == {
        "kind": "head", "family": "colar",
        "controls": ["thinking", "max_latent", "latent_budget", "min_latent", "use_stop",
                     "compression_factor", "latent_temperature"],
        "budget": None, "max_compression_factor": 5, "exit_criteria": None,
        "block_size": None, "return_latent_trace": True, "stream_latent_steps": True}


def test_plain_model_card_has_no_latent(http):
    assert http.get("/v1/models").json()["data"][0]["latent"] is None
