"""Recurrent depth over HTTP (issue 7): a tiny Huginn checkpoint served with a server cap on
the recurrence count (``max_latent_budget``); the exit-rule fields reach the engine, the
answer and the iterations per token equal the eager upstream-algorithm reference, and
``return_latent_trace`` returns the per-request recurrence stats and each generated token's
depth (``latent.trace``), streamed (final chunk) or not, on the completions, chat and messages
routes; a model without a trace refuses the field with a 400 naming it on every route."""

import json

import httpx
import pytest
from server_testlib import assert_slots_invariant, wait_idle

PROMPT = [(7 * i + 11) % 900 + 20 for i in range(12)]
MAX_TOKENS = 6
SERVER_CAP = 6  # the checkpoint allows 8


@pytest.fixture(scope="module")
def huginn_dir(tmp_path_factory, smollm2_dir):
    from transformers import AutoTokenizer

    from latentserve.bench.baseline.recurrent_models import write_huginn

    d = write_huginn(tmp_path_factory.mktemp("recurrent-api") / "huginn")
    tok = AutoTokenizer.from_pretrained(d)  # a chat template that renders the contents only
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(d)
    return d


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


def _reference(huginn_dir, depth, criterion=None, threshold="auto", semantics="engine"):
    from tests.support.recurrent_reference import HuginnReference

    ref = HuginnReference(huginn_dir).generate(PROMPT, MAX_TOKENS, depth, criterion, threshold,
                                               semantics=semantics)
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
    assert latent["trace"] == [{"depth": n} for n in iters]
    assert_slots_invariant(wait_idle(http))


EXIT = {"latent_budget": SERVER_CAP, "exit_criterion": "latent-diff", "exit_threshold": 0.2}
TEXT = " ".join(f"w{i}" for i in PROMPT)  # the word tokenizer: exactly PROMPT's ids


@pytest.mark.parametrize("stream", [False, True])
def test_chat_route_returns_the_per_token_depths(http, huginn_dir, stream):
    tokens, iters, _ = _reference(huginn_dir, SERVER_CAP, "latent-diff", 0.2)
    body = {"messages": [{"role": "user", "content": TEXT}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True, "return_latent_trace": True,
            "logprobs": True, "return_tokens_as_token_ids": True, "stream": stream, **EXIT}
    ids, latent = [], None
    if stream:
        with http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        if c["logprobs"]:
                            ids += [int(t["token"].removeprefix("token_id:"))
                                    for t in c["logprobs"]["content"]]
                        if c["finish_reason"]:
                            latent = c["latent"]
                        else:  # the trace comes with the final chunk only
                            assert c.get("latent") is None, c
    else:
        r = http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        ids = [int(t["token"].removeprefix("token_id:")) for t in choice["logprobs"]["content"]]
        latent = choice["latent"]
    assert ids == tokens  # the template rendered PROMPT's ids
    assert latent["trace"] == [{"depth": n} for n in iters]
    assert min(iters) < SERVER_CAP


def test_messages_route_returns_the_per_token_depths(http, huginn_dir):
    _, iters, _ = _reference(huginn_dir, SERVER_CAP, "latent-diff", 0.2)
    body = {"model": str(huginn_dir), "max_tokens": MAX_TOKENS, "temperature": 0,
            "messages": [{"role": "user", "content": TEXT}], **EXIT}
    # ignore_eos is not an Anthropic field: the answer may end early, so compare a prefix.
    r = http.post("/v1/messages", json={**body, "return_latent_trace": True})
    assert r.status_code == 200, r.text
    msg = r.json()
    trace = msg["latent"]["trace"]
    assert trace == [{"depth": n} for n in iters[: msg["usage"]["output_tokens"]]]
    assert msg["latent"]["recurrence"]["tokens"] == len(trace)
    plain = http.post("/v1/messages", json=body)  # not asked: no latent field at all
    assert plain.status_code == 200 and "latent" not in plain.json(), plain.text


def test_default_depth_runs_without_a_trace_field(http, huginn_dir):
    tokens, _, _ = _reference(huginn_dir, 4)  # the checkpoint's mean_recurrence
    absent = {k: v for k, v in _body().items() if k != "return_latent_trace"}
    for body in (_body(return_latent_trace=False), absent):
        r = http.post("/v1/completions", json=body)
        choice = r.json()["choices"][0]
        assert _ids(choice["logprobs"]) == tokens
        assert choice["latent"] is None  # not asked, and no latent steps


@pytest.mark.parametrize("semantics", ["engine", "upstream"])
def test_exit_semantics_body_field_reaches_the_engine(http, huginn_dir, semantics):
    fields = {**EXIT, "exit_criterion": "kl", "exit_threshold": 0.01}
    tokens, iters, _ = _reference(huginn_dir, SERVER_CAP, "kl", 0.01, semantics)
    r = http.post("/v1/completions", json=_body(exit_semantics=semantics, **fields))
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert _ids(choice["logprobs"]) == tokens
    assert choice["latent"]["trace"] == [{"depth": n} for n in iters]
    if semantics == "upstream":  # the prompt exits early only under upstream's semantics
        assert iters[0] < SERVER_CAP
    assert_slots_invariant(wait_idle(http))


@pytest.mark.parametrize("fields,param,words", [
    ({"exit_semantics": "latest"}, "exit_semantics", ["engine", "upstream"]),
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


def test_plain_model_refuses_exit_semantics_on_every_route(server, model):
    from server_testlib import API_KEY

    msgs = [{"role": "user", "content": "hi"}]
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": msgs}),
                       ("/v1/messages", {"model": model, "messages": msgs})):
        r = httpx.post(f"{server.base_url}{path}", timeout=60,
                       headers={"Authorization": f"Bearer {API_KEY}", "x-api-key": API_KEY},
                       json={**body, "max_tokens": 2, "exit_semantics": "upstream"})
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        if path == "/v1/messages":  # Anthropic's field: reason form, no param
            assert err["message"].startswith("exit_semantics: needs a recurrent-depth"), err
        else:
            assert err["message"].startswith("exit_semantics needs a recurrent-depth"), err
            assert err["param"] == "exit_semantics", (path, err)


def test_plain_model_refuses_return_latent_trace_on_every_route(server, model):
    """A model without a latent trace: a 400 in each protocol's error body, naming the
    field, not a response that silently lacks the trace."""
    from server_testlib import API_KEY

    msgs = [{"role": "user", "content": "hi"}]
    for path, body in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": msgs}),
                       ("/v1/messages", {"model": model, "messages": msgs})):
        r = httpx.post(f"{server.base_url}{path}", timeout=60,
                       headers={"Authorization": f"Bearer {API_KEY}", "x-api-key": API_KEY},
                       json={**body, "max_tokens": 2, "return_latent_trace": True})
        assert r.status_code == 400, (path, r.text)
        if path == "/v1/messages":  # Anthropic's error body has no param
            assert r.json()["type"] == "error"
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error"
            assert err["message"].startswith("return_latent_trace: needs"), err
        else:
            err = r.json()["error"]
            assert err["param"] == "return_latent_trace", (path, err)
            assert err["message"].startswith("return_latent_trace needs"), (path, err)


def test_messages_route_passes_the_exit_fields_on():
    """/v1/messages takes the same exit fields as the OpenAI routes (they were dropped)."""
    from types import SimpleNamespace

    from latentserve.latent.spec import LatentSpec
    from latentserve.server.anthropic_api import MessagesRequest, _Answer, _request_params
    from latentserve.server.state import ServerLimits
    from latentserve.server.tools import ToolChoice

    spec = LatentSpec(kind="recurrent", family="huginn", default_budget=4, max_budget=8)
    state = SimpleNamespace(max_model_len=64, latent_spec=spec, sampling_defaults=None,
                            reasoning_parser=None, tool_parser=None, tokenizer=None,
                            limits=ServerLimits())

    def _params(**fields):
        body = MessagesRequest(model="m", max_tokens=4, **fields,
                               messages=[{"role": "user", "content": "a"}])
        return _request_params(body, None, state, [5, 6, 7],
                               _Answer({}, ToolChoice("none"), None, None))

    params = _params(exit_criterion="kl", exit_threshold=0.01, exit_min_steps=2,
                     exit_check_every=3, exit_semantics="upstream", latent_budget=5)
    assert (params.latent_budget, params.exit_criterion, params.exit_threshold,
            params.exit_min_steps, params.exit_check_every,
            params.exit_semantics) == (5, "kl", 0.01, 2, 3, "upstream")
    assert not params.return_latent_trace
    assert _params(return_latent_trace=True).return_latent_trace
    plain = _params()
    assert (plain.exit_criterion, plain.exit_min_steps, plain.exit_check_every,
            plain.exit_semantics) == (None, 0, 1, None)
