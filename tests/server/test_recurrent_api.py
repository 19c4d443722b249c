"""Recurrent depth over HTTP (issue 7): a tiny Huginn checkpoint served with a server cap on
the recurrence count (``max_latent_budget``); the exit-rule fields reach the engine, the
answer and the iterations per token equal the eager upstream-algorithm reference, and
``return_latent_trace`` returns the per-request recurrence stats, streamed or not."""

import json

import httpx
import pytest
from server_testlib import assert_slots_invariant, wait_idle

PROMPT = [(7 * i + 11) % 900 + 20 for i in range(12)]
MAX_TOKENS = 6
SERVER_CAP = 6  # the checkpoint allows 8


@pytest.fixture(scope="module")
def huginn_dir(tmp_path_factory, smollm2_dir):
    from latentserve.testing.recurrent_models import write_huginn

    return write_huginn(tmp_path_factory.mktemp("recurrent-api") / "huginn")


@pytest.fixture(scope="module")
def huginn_server(huginn_dir):
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    srv = start_server(EngineConfig(model=str(huginn_dir), max_num_seqs=4, kv_slots=2048,
                                    max_latent_budget=SERVER_CAP), timeout=300)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def http(huginn_server):
    with httpx.Client(base_url=huginn_server.base_url, timeout=120) as c:
        yield c


def _body(**fields):
    return {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, "return_latent_trace": True,
            **fields}


def _reference(huginn_dir, depth, criterion=None, threshold="auto"):
    from latentserve.testing.recurrent_reference import HuginnReference

    ref = HuginnReference(huginn_dir).generate(PROMPT, MAX_TOKENS, depth, criterion, threshold)
    hist: dict[str, int] = {}
    for n in ref["iterations"]:
        hist[str(n)] = hist.get(str(n), 0) + 1
    return ref["tokens"], ref["iterations"], dict(sorted(hist.items(), key=lambda kv: int(kv[0])))


def _ids(logprobs) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]


@pytest.mark.parametrize("stream", [False, True])
def test_exit_rule_fields_reach_the_engine_and_stats_match_the_reference(
        http, huginn_dir, stream):
    fields = {"latent_budget": SERVER_CAP, "exit_criterion": "latent-diff",
              "exit_threshold": 0.2}
    tokens, iters, hist = _reference(huginn_dir, SERVER_CAP, "latent-diff", 0.2)
    assert min(iters) < SERVER_CAP  # the rule does exit early on this checkpoint
    if stream:
        ids, latent = [], None
        with http.stream("POST", "/v1/completions", json=_body(stream=True, **fields)) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        ids += _ids(c["logprobs"]) if c["logprobs"] else []
                        if c["finish_reason"]:
                            latent = c["latent"]
    else:
        r = http.post("/v1/completions", json=_body(**fields))
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        ids, latent = _ids(choice["logprobs"]), choice["latent"]
    assert ids == tokens
    rec = latent["recurrence"]
    assert rec["tokens"] == MAX_TOKENS and rec["histogram"] == hist
    assert rec["mean_iterations"] == pytest.approx(sum(iters) / len(iters))
    assert_slots_invariant(wait_idle(http))


def test_default_depth_runs_without_a_trace_field(http, huginn_dir):
    tokens, _, _ = _reference(huginn_dir, 4)  # the checkpoint's mean_recurrence
    r = http.post("/v1/completions", json=_body(return_latent_trace=False))
    choice = r.json()["choices"][0]
    assert _ids(choice["logprobs"]) == tokens
    assert choice["latent"] is None  # not asked, and no latent steps


@pytest.mark.parametrize("fields,param,words", [
    ({"latent_budget": SERVER_CAP + 1}, "latent_budget", [f"[0, {SERVER_CAP}]"]),
    ({"exit_criterion": "bogus"}, "exit_criterion", ["bogus"]),
    ({"exit_threshold": -1.0, "exit_criterion": "kl"}, "exit_threshold", ["exit_threshold"]),
    ({"exit_check_every": 0, "exit_criterion": "kl"}, "exit_check_every", ["exit_check_every"]),
    ({"exit_criterion": 3}, "exit_criterion", ["exit_criterion"]),
])
def test_bad_recurrence_fields_are_400s_naming_them(http, fields, param, words):
    r = http.post("/v1/completions", json=_body(**fields))
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    for w in words:
        assert w in error["message"], error["message"]
    assert_slots_invariant(wait_idle(http))


def test_plain_model_refuses_exit_fields(server, model):
    from server_testlib import API_KEY

    r = httpx.post(f"{server.base_url}/v1/completions", timeout=60,
                   headers={"Authorization": f"Bearer {API_KEY}"},
                   json={"prompt": "hi", "max_tokens": 2, "exit_criterion": "kl"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "exit_criterion"


def test_messages_route_passes_the_exit_fields_on():
    """/v1/messages takes the same exit fields as the OpenAI routes (they were dropped)."""
    from latentserve.server.anthropic_api import MessagesRequest, _params

    body = MessagesRequest(model="m", max_tokens=4, messages=[{"role": "user", "content": "a"}],
                           exit_criterion="kl", exit_threshold=0.01, exit_min_steps=2,
                           exit_check_every=3)
    params = _params(body, 3, 64, budget=5)
    assert (params.latent_budget, params.exit_criterion, params.exit_threshold,
            params.exit_min_steps, params.exit_check_every) == (5, "kl", 0.01, 2, 3)
    plain = _params(MessagesRequest(model="m", max_tokens=4,
                                    messages=[{"role": "user", "content": "a"}]), 3, 64)
    assert (plain.exit_criterion, plain.exit_min_steps, plain.exit_check_every) == (None, 0, 1)
