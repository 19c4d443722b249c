"""CoLaR's per-request controls through the HTTP API (latent/colar_head.py): the body fields
``compression_factor`` / ``latent_temperature`` and the headers
``x-latent-compression-factor`` / ``x-latent-temperature`` (header > body > the model's
``colar_config.json``) on /v1/completions, /v1/chat/completions and /v1/messages; a value
out of range, a malformed header or a compression-head-only control is a 400 with the
route's error body naming what was sent; ``latent.stats`` reports the speed and the run."""

import httpx
import pytest
from server_testlib import assert_slots_invariant, wait_idle

QUESTION = "Question: w40 w41 w42 w43 Let's think step by step:"
MSGS = [{"role": "user", "content": "w40 w41 w42 w43"}]


@pytest.fixture(scope="module")
def colar_server(tmp_path_factory):
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server
    from tests.support.colar_models import save_colar_tiny

    d = save_colar_tiny(tmp_path_factory.mktemp("colar-api") / "m", stop_push=16.0,
                        compression_factor=2, max_compression_factor=5, max_latent=6)
    srv = start_server(EngineConfig(model=str(d), max_num_seqs=8), timeout=300,
                       max_request_output_tokens=400)
    srv.model_dir = str(d)
    yield srv
    srv.stop()


def _complete(srv, body=None, headers=None):
    body = {"prompt": QUESTION, "max_tokens": 4, "temperature": 0, **(body or {})}
    return httpx.post(f"{srv.base_url}/v1/completions", json=body, headers=headers or {},
                      timeout=60)


def _stats(r):
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["latent"]["stats"]


def _openai_400(r, param):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    return err["message"]


def test_defaults_come_from_colar_config(colar_server):
    s = _stats(_complete(colar_server))
    assert (s["compression_factor"], s["max_latent"], s["min_latent"]) == (2, 6, 0)
    assert s["latent_temperature"] == 0.0 and s["use_stop"] is True
    assert "stop_threshold" not in s and "min_output_tokens" not in s


def test_card_lists_latent_budget_the_alias_of_max_latent(colar_server):
    card = httpx.get(f"{colar_server.base_url}/v1/models", timeout=30).json()["data"][0]
    controls = card["latent"]["controls"]
    assert controls[controls.index("max_latent") + 1] == "latent_budget"
    assert _stats(_complete(colar_server, {"latent_budget": 2}))["max_latent"] == 2
    assert _stats(_complete(colar_server, {}, {"x-latent-budget": "3"}))["max_latent"] == 3
    assert "latent_budget must equal max_latent" in _openai_400(
        _complete(colar_server, {"latent_budget": 2, "max_latent": 4}), "latent_budget")


def test_body_field_and_header_precedence(colar_server):
    assert _stats(_complete(colar_server, {"compression_factor": 4}))["compression_factor"] == 4
    s = _stats(_complete(colar_server, {"compression_factor": 4},
                         {"x-latent-compression-factor": "5", "x-latent-max": "2"}))
    assert (s["compression_factor"], s["max_latent"]) == (5, 2) and s["steps"] <= 2
    s = _stats(_complete(colar_server, {"latent_temperature": 0.5, "seed": 3},
                         {"x-latent-temperature": "0.25"}))
    assert s["latent_temperature"] == 0.25


def test_seeded_latent_temperature_is_reproducible(colar_server):
    body = {"latent_temperature": 1.0, "seed": 11, "use_stop": False, "max_tokens": 6}
    a, b = _complete(colar_server, body), _complete(colar_server, body)
    assert a.status_code == b.status_code == 200
    assert a.json()["choices"][0]["text"] == b.json()["choices"][0]["text"]


@pytest.mark.parametrize("body,headers,param", [
    ({"compression_factor": 6}, {}, "compression_factor"),
    ({"compression_factor": 0}, {}, "compression_factor"),
    ({}, {"x-latent-compression-factor": "9"}, "x-latent-compression-factor"),
    ({}, {"x-latent-compression-factor": "fast"}, "x-latent-compression-factor"),
    ({"latent_temperature": -0.5}, {}, "latent_temperature"),
    ({}, {"x-latent-temperature": "-1"}, "x-latent-temperature"),
    ({}, {"x-latent-temperature": "nan"}, "x-latent-temperature"),
    ({}, {"x-latent-temperature": "1e39"}, "x-latent-temperature"),
    ({"latent_temperature": 3.5e38}, {}, "latent_temperature"),
    ({"stop_threshold": 0.5}, {}, "stop_threshold"),
    ({}, {"x-ds4-min-output-tokens": "0"}, "x-ds4-min-output-tokens")])
def test_bad_or_foreign_control_is_a_400_naming_it(colar_server, body, headers, param):
    message = _openai_400(_complete(colar_server, body, headers), param)
    assert param in message


def test_chat_route_takes_the_controls(colar_server):
    url = f"{colar_server.base_url}/v1/chat/completions"
    r = httpx.post(url, timeout=60, headers={"x-latent-compression-factor": "3"},
                   json={"messages": MSGS, "max_tokens": 4, "temperature": 0})
    assert _stats(r)["compression_factor"] == 3
    bad = httpx.post(url, timeout=60, json={"messages": MSGS, "max_tokens": 4,
                                            "compression_factor": 8})
    assert "[1, 5]" in _openai_400(bad, "compression_factor")


def test_messages_route_takes_the_controls_and_answers_anthropic_errors(colar_server):
    url = f"{colar_server.base_url}/v1/messages"
    body = {"model": colar_server.model_dir, "max_tokens": 4, "messages": MSGS}
    ok = httpx.post(url, timeout=60, json={**body, "compression_factor": 5,
                                           "latent_temperature": 0})
    assert ok.status_code == 200, ok.text
    assert ok.json()["latent"]["stats"]["compression_factor"] == 5
    for extra, headers, param in (({}, {"x-latent-compression-factor": "7"},
                                   "x-latent-compression-factor"),
                                  ({"latent_temperature": -2.0}, {}, "latent_temperature")):
        bad = httpx.post(url, timeout=60, json={**body, **extra}, headers=headers)
        assert bad.status_code == 400, bad.text
        err = bad.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        assert param in err["error"]["message"]
    with httpx.Client(base_url=colar_server.base_url) as http:
        assert_slots_invariant(wait_idle(http))


def test_latent_steps_count_against_the_context_and_the_request_limit(colar_server):
    """A sent cap counts as latent positions against the context (vLLM's ``max_tokens``
    check): over it is the context-length 400, naming ``max_tokens`` when it was sent, else
    ``max_latent``. ``n`` x (``max_tokens`` + the cap) meets ``--max-request-output-tokens``."""
    err = _openai_400(_complete(colar_server, {"max_latent": 10**9}), "max_tokens")
    assert "latent and transition positions" in err
    r = _complete(colar_server, {"max_tokens": None}, {"x-latent-max": str(10**9)})
    assert "latent and transition positions, at least 1 in the completion" in \
        _openai_400(r, "x-latent-max")
    r = _complete(colar_server, {"n": 16, "max_tokens": 100, "max_latent": 200})
    assert ("got 4800 (1 prompt(s), n=16, max_tokens up to 100 plus up to 200 latent steps "
            "(max_latent))") in _openai_400(r, "max_tokens")  # the server's limit: 400
    with httpx.Client(base_url=colar_server.base_url) as http:
        assert_slots_invariant(wait_idle(http))


def test_contradicting_caps_are_a_400_on_every_route(colar_server):
    """``max_latent`` and ``latent_budget`` are one control: differing values, or a
    ``min_latent`` above ``latent_budget``, are a 400 naming it, as the header that sent it
    where one did (they were a 500 on the OpenAI routes), Anthropic's message in its
    ``field: reason`` form."""
    for body, headers in (({"max_latent": 5, "latent_budget": 6}, {}),
                          ({"max_latent": 5}, {"x-latent-budget": "4"}),
                          ({"min_latent": 5, "latent_budget": 3}, {})):
        param = "min_latent" if "min_latent" in body else "latent_budget"
        param = "x-latent-budget" if headers else param
        _openai_400(_complete(colar_server, body, headers), param)
        r = httpx.post(f"{colar_server.base_url}/v1/chat/completions", timeout=60,
                       headers=headers, json={"messages": MSGS, "max_tokens": 2, **body})
        _openai_400(r, param)
        r = httpx.post(f"{colar_server.base_url}/v1/messages", timeout=60, headers=headers,
                       json={"model": colar_server.model_dir, "max_tokens": 2,
                             "messages": MSGS, **body})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith(
            f"header {param} must" if headers else f"{param}: must"), r.text


def test_latent_positions_are_counted_as_the_engine_runs_them(colar_server):
    """A whole prompt (ending with ``###``) gets no speed appended, so none is counted;
    ``thinking_token_budget`` caps the latent steps counted; a header cap that fills the
    context is refused naming the header; the prompt's speed out of range names ``prompt``."""
    spec = httpx.get(f"{colar_server.base_url}/v1/models", timeout=60).json()
    assert spec["data"][0]["max_model_len"] == 512
    whole = QUESTION.replace("w40", "w40 " * 400) + " (Thinking speed: 3)###"
    n = len(httpx.post(f"{colar_server.base_url}/tokenize", timeout=60,
                       json={"prompt": whole}).json()["tokens"])
    fits = {"prompt": whole, "max_tokens": 9, "max_latent": 512 - n - 1 - 9}
    assert _complete(colar_server, fits).status_code == 200
    over = _complete(colar_server, {**fits, "max_tokens": 10})
    assert f"you requested 513 tokens ({n} in the prompt" in _openai_400(over, "max_tokens")
    r = httpx.post(f"{colar_server.base_url}/v1/chat/completions", timeout=60, json={
        "messages": MSGS, "max_tokens": 2, "max_latent": 600, "thinking_token_budget": 5})
    assert r.status_code == 200, r.text
    r = _complete(colar_server, {"max_tokens": None}, {"x-latent-max": "600"})
    assert "reduce the length of the prompt or x-latent-max" in _openai_400(r, "x-latent-max")
    r = _complete(colar_server, {"prompt": QUESTION + " (Thinking speed: 6)###"})
    assert _openai_400(r, "prompt").startswith("prompt names (Thinking speed: 6)")
    r = httpx.post(f"{colar_server.base_url}/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "w5 " * 600}]})
    _openai_400(r, "messages")  # an over-long prompt names the route's own field


def test_messages_route_meets_the_request_output_limit(colar_server):
    """--max-request-output-tokens (400 here) holds on /v1/messages too, with the cap."""
    body = {"model": colar_server.model_dir, "messages": MSGS}
    for extra in ({"max_tokens": 401}, {"max_tokens": 395, "max_latent": 10}):
        r = httpx.post(f"{colar_server.base_url}/v1/messages", timeout=60,
                       json={**body, **extra})
        assert r.status_code == 400 and "must be at most 400 tokens per request" in \
            r.json()["error"]["message"], r.text
