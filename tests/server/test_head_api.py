"""Compression-head controls through the HTTP API (issue 6): a tiny Llama directory with a
random head bundle inside serves with the head and no flags; per request, headers
``x-latent-*`` (aliases ``x-ds4-*``) > body fields > server env defaults; a malformed header
is a 400 naming it; each choice's ``latent.stats`` reports the run (and thinking off)."""

import json
import os
import time

import httpx
import pytest
from server_testlib import assert_slots_invariant, stand_in_app, wait_idle

ENV = {"LATENTSERVE_MAX_LATENT": "3", "LATENTSERVE_USE_STOP": "0",
       "LATENTSERVE_MIN_OUTPUT_TOKENS": "0"}


@pytest.fixture(scope="module")
def head_server(tmp_path_factory, smollm2_dir):
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server
    from tests.support.head_models import save_head_model

    d = save_head_model(tmp_path_factory.mktemp("head-api") / "m")
    saved = {k: os.environ.get(k) for k in ENV}
    os.environ.update(ENV)  # the engine process reads the defaults at start-up
    try:  # debug: the engine's per-request latent log line (test_log_level_debug_...)
        srv = start_server(EngineConfig(model=str(d), max_num_seqs=8), timeout=300,
                           log_level="debug")
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    srv.model_dir = str(d)
    yield srv
    srv.stop()


def _complete(srv, body=None, headers=None):
    body = {"prompt": [11, 12, 13, 14], "max_tokens": 12, "temperature": 0, **(body or {})}
    return httpx.post(f"{srv.base_url}/v1/completions", json=body, headers=headers or {},
                      timeout=60)


def _stats(r):
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["latent"]["stats"]


def test_env_defaults_body_and_header_precedence(head_server):
    s = _stats(_complete(head_server))
    assert (s["max_latent"], s["steps"], s["end"], s["use_stop"]) == (3, 3, "cap", False)
    assert _stats(_complete(head_server, {"max_latent": 2}))["steps"] == 2
    assert _stats(_complete(head_server, {"max_latent": 2},
                            {"x-ds4-max-latent": "5"}))["steps"] == 5
    assert _stats(_complete(head_server, {"max_latent": 2},
                            {"x-ds4-max-latent": "5", "x-latent-max": "1"}))["steps"] == 1
    s = _stats(_complete(head_server, {"stop_threshold": 0.2},
                         {"x-latent-use-stop": "1", "x-latent-min": "0"}))
    assert s["use_stop"] is True and s["stop_threshold"] == 0.2 and s["min_latent"] == 0
    with httpx.Client(base_url=head_server.base_url) as http:
        assert_slots_invariant(wait_idle(http))


def test_thinking_off_says_so(head_server):
    s = _stats(_complete(head_server, headers={"x-latent-thinking": "0"}))
    assert s["thinking"] is False and s["steps"] == 0
    r = httpx.post(f"{head_server.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
        "chat_template_kwargs": {"enable_thinking": False}})
    assert _stats(r)["thinking"] is False


@pytest.mark.parametrize("header,value", [("x-latent-max", "lots"),
                                          ("x-ds4-stop-threshold", "7"),
                                          ("x-ds4-thinking", "perhaps")])
def test_malformed_header_is_400_naming_it(head_server, header, value):
    r = _complete(head_server, headers={header: value})
    assert r.status_code == 400 and header in r.text


_ROUTE_BODIES = {
    "/v1/completions": {"prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/messages": {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 2},
    "/v1/messages/count_tokens": {"model": "m",
                                  "messages": [{"role": "user", "content": "hi"}]},
}


@pytest.mark.parametrize("header", ["x-latent-bogus", "X-Latent-Maxx", "x-ds4-max"])
@pytest.mark.parametrize("route", list(_ROUTE_BODIES))
def test_an_unknown_latent_header_is_a_400_naming_it(smollm2_tokenizer, route, header):
    """A typo of a latent header would do nothing: it is refused by name on every
    generation route, with the headers the server takes; a known one, off, is served."""
    with stand_in_app(smollm2_tokenizer) as app:
        r = app.post(route, json=_ROUTE_BODIES[route], headers={header: "1"})
        assert r.status_code == 400, r.text
        message = r.text
        assert f"header {header.lower()} is not a header this server takes" in message
        assert "x-latent-max, x-ds4-max-latent" in message  # the known ones are listed
        ok = app.post(route, json=_ROUTE_BODIES[route], headers={"x-latent-thinking": "0"})
        assert ok.status_code == 200, ok.text


def test_tokenize_leaves_latent_headers_alone(smollm2_tokenizer):
    """/tokenize runs nothing latent: it neither reads nor refuses the headers."""
    with stand_in_app(smollm2_tokenizer) as app:
        r = app.post("/tokenize", json={"prompt": "hi"}, headers={"x-latent-bogus": "1"})
        assert r.status_code == 200, r.text


def test_tokenize_reads_template_thinking_as_the_chat_route(smollm2_tokenizer):
    """A string "false" renders as false (Jinja would take the string as true) and a value
    that is no boolean is a 400 naming its key, as on the chat route."""
    import copy

    tok = copy.deepcopy(smollm2_tokenizer)
    tok.chat_template = ("{% if enable_thinking %}<think>{% endif %}"
                         "{{ messages[-1]['content'] }}")
    msgs = [{"role": "user", "content": "hi"}]

    def count(kwargs):
        r = app.post("/tokenize", json={"messages": msgs, "chat_template_kwargs": kwargs})
        assert r.status_code == 200, r.text
        return r.json()["count"]

    with stand_in_app(tok) as app:
        assert count({"enable_thinking": "false"}) == count({}) < count({"thinking": True})
        for kwargs, key in (({"enable_thinking": "maybe"}, "enable_thinking"),
                            ({"thinking": True, "enable_thinking": False}, "enable_thinking")):
            r = app.post("/tokenize", json={"messages": msgs, "chat_template_kwargs": kwargs})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == f"chat_template_kwargs.{key}"


def test_messages_route_takes_headers(head_server):
    r = httpx.post(f"{head_server.base_url}/v1/messages", timeout=60,
                   headers={"x-ds4-max-latent": "2", "x-ds4-min-output-tokens": "0"},
                   json={"model": head_server.model_dir, "max_tokens": 3,
                         "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    bad = httpx.post(f"{head_server.base_url}/v1/messages", timeout=60,
                     headers={"x-latent-use-stop": "sometimes"},
                     json={"model": head_server.model_dir, "max_tokens": 3,
                           "messages": [{"role": "user", "content": "hi"}]})
    assert bad.status_code == 400 and "x-latent-use-stop" in bad.text


def test_count_tokens_checks_the_headers_messages_checks(head_server):
    """``/v1/messages/count_tokens`` refuses what ``/v1/messages`` refuses (a malformed
    ``x-latent-*`` header, a 400 naming it) and counts the same with valid ones."""
    body = {"model": head_server.model_dir, "messages": [{"role": "user", "content": "hi"}]}
    url = f"{head_server.base_url}/v1/messages/count_tokens"
    plain = httpx.post(url, json=body, timeout=60)
    ok = httpx.post(url, json=body, headers={"x-latent-max": "2"}, timeout=60)
    assert plain.status_code == ok.status_code == 200, (plain.text, ok.text)
    assert ok.json()["input_tokens"] == plain.json()["input_tokens"] > 0
    for header, value in (("x-latent-max", "lots"), ("x-latent-budget", "-1"),
                          ("x-latent-stream-steps", "maybe")):
        bad = httpx.post(url, json=body, headers={header: value}, timeout=60)
        assert bad.status_code == 400 and header in bad.text, bad.text
        assert bad.json()["type"] == "error"


def test_messages_route_refuses_the_stream_steps_header(head_server):
    """/v1/messages has no per-step ticks (its thinking block shows latent steps per
    ``latent_reasoning``): ``x-latent-stream-steps`` asking for them is a 400 naming it,
    streamed or not; a malformed one too; off is harmless, as on the OpenAI routes."""
    body = {"model": head_server.model_dir, "max_tokens": 3,
            "messages": [{"role": "user", "content": "hi"}]}
    for value, stream, words in (
            ("sometimes", False, "x-latent-stream-steps must be a boolean"),
            ("1", True, "header x-latent-stream-steps is not taken on /v1/messages"),
            ("yes", False, "header x-latent-stream-steps is not taken on /v1/messages")):
        bad = httpx.post(f"{head_server.base_url}/v1/messages", timeout=60,
                         headers={"x-latent-stream-steps": value},
                         json={**body, "stream": stream})
        assert bad.status_code == 400 and words in bad.json()["error"]["message"], bad.text
    for headers in ({}, {"x-latent-stream-steps": "0"}):
        ok = httpx.post(f"{head_server.base_url}/v1/messages", timeout=60, json=body,
                        headers=headers)
        assert ok.status_code == 200, ok.text


def test_stream_steps_without_stream_are_refused(head_server):
    """Ticks are stream chunks: the field or the header without ``stream`` is a 400 naming
    what was sent, on both OpenAI routes."""
    for path, body in (("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}]}),
                       ("/v1/completions", {"prompt": "hi"})):
        for extra, headers, param in (({"stream_latent_steps": True}, {}, "stream_latent_steps"),
                                      ({}, {"x-latent-stream-steps": "1"},
                                       "x-latent-stream-steps")):
            r = httpx.post(f"{head_server.base_url}{path}", timeout=60, headers=headers,
                           json={**body, "max_tokens": 3, **extra})
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["param"] == param and err["message"] == (
                f"{param} needs stream: true (each latent step is a stream chunk)")


def _steps_total(server) -> float:
    """``latentserve_latent_steps_total`` from the server's Prometheus metrics."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    line = next(x for x in text.splitlines() if x.startswith("latentserve_latent_steps_total"))
    return float(line.rsplit(" ", 1)[1])


def test_messages_route_takes_the_thinking_object_and_body_controls(head_server):
    """Anthropic's thinking {"type": "disabled"} turns the latent phase off (it was a 500);
    body controls act as on the OpenAI routes."""
    url, msgs = f"{head_server.base_url}/v1/messages", [{"role": "user", "content": "hi"}]

    before = _steps_total(head_server)
    off = httpx.post(url, timeout=60, json={"model": head_server.model_dir, "max_tokens": 3,
                                            "messages": msgs, "thinking": {"type": "disabled"}})
    assert off.status_code == 200, off.text
    assert _steps_total(head_server) == before  # no latent step
    on = httpx.post(url, timeout=60, json={"model": head_server.model_dir, "max_tokens": 8,
                                           "messages": msgs, "max_latent": 2,
                                           "min_output_tokens": 0, "use_stop": False,
                                           "thinking": {"type": "enabled",
                                                        "budget_tokens": 1024}})
    assert on.status_code == 200, on.text
    assert _steps_total(head_server) == before + 2  # the body's max_latent took effect
    assert on.json()["latent"]["stats"]["steps"] == 2  # the OpenAI routes' latent object
    assert off.json()["latent"]["stats"]["thinking"] is False  # says the head sat idle


def test_messages_stream_carries_latent_stats_on_message_delta(head_server):
    import json

    with httpx.stream("POST", f"{head_server.base_url}/v1/messages", timeout=60,
                      json={"model": head_server.model_dir, "max_tokens": 6, "stream": True,
                            "messages": [{"role": "user", "content": "hi"}],
                            "max_latent": 3, "min_output_tokens": 0,
                            "use_stop": False}) as r:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ")]
    delta = next(e for e in events if e["type"] == "message_delta")
    assert delta["latent"]["stats"]["steps"] == 3 and delta["latent"]["steps"] == 3
    assert all("latent" not in e for e in events if e["type"] != "message_delta")


def test_prometheus_counts_latent_steps(head_server):
    before = _steps_total(head_server)
    assert _stats(_complete(head_server, {"max_latent": 2}))["steps"] == 2
    assert _steps_total(head_server) == before + 2
    text = httpx.get(f"{head_server.base_url}/metrics", timeout=30).text
    assert "latentserve_latent_steps_per_request_bucket" in text


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_keeps_the_stats_and_the_step_count(head_server, stream):
    """A thinking request that a stop string ends (aborted in the engine, no final output)
    still reports its latent stats, and its steps reach the Prometheus counter."""
    full = _complete(head_server, {"max_latent": 2, "max_tokens": 16, "ignore_eos": True})
    text = full.json()["choices"][0]["text"]
    stop = text[len(text) // 2:][:3]
    assert stop.strip(), text
    before = _steps_total(head_server)
    body = {"prompt": [11, 12, 13, 14], "max_tokens": 16, "temperature": 0,
            "max_latent": 2, "ignore_eos": True, "stop": [stop], "stream": stream}
    if stream:
        final = None
        with httpx.stream("POST", f"{head_server.base_url}/v1/completions", json=body,
                          timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0].get("finish_reason"):
                        final = chunk["choices"][0]
    else:
        r = httpx.post(f"{head_server.base_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        final = r.json()["choices"][0]
    assert final["finish_reason"] == "stop" and stop not in final.get("text", "")
    s = final["latent"]["stats"]
    assert (s["steps"], s["end"], s["thinking"]) == (2, "cap", True)
    assert _steps_total(head_server) == before + 2
    with httpx.Client(base_url=head_server.base_url) as http:
        assert_slots_invariant(wait_idle(http))


def test_streamed_ticks_match_the_latent_steps_and_stats_ride_the_finish_chunk(head_server):
    import json

    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8,
            "temperature": 0, "stream": True, "max_latent": 3}
    choices = []
    with httpx.stream("POST", f"{head_server.base_url}/v1/chat/completions", json=body,
                      headers={"x-latent-stream-steps": "true"}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                choices += json.loads(line[6:])["choices"]
    ticks = [c for c in choices if "reasoning_content" in c["delta"]]
    finish = [c for c in choices if c["finish_reason"]]
    assert len(finish) == 1
    stats = finish[0]["latent"]["stats"]
    assert stats["thinking"] is True and len(ticks) == stats["steps"] == 3


def test_log_level_debug_reaches_the_engine_per_request_latent_log_line(head_server):
    """``--log-level debug`` logs each head request's latent stats (the engine's debug
    line); the engine process used to log at INFO whatever the flag said."""
    before = len(head_server.log_path.read_text(errors="replace"))

    def since():
        return head_server.log_path.read_text(errors="replace")[before:]

    r = _complete(head_server, {"max_tokens": 4, "max_latent": 2, "use_stop": False,
                                "min_output_tokens": 0})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 30
    while "latent head: req" not in since() and time.monotonic() < deadline:
        time.sleep(0.2)
    lines = [x for x in since().splitlines() if "latent head: req" in x]
    assert lines and "steps=2" in lines[0], since()[-2000:]


def test_answer_budget_floor_counts_in_the_request_output_limit(tmp_path, smollm2_dir):
    """``--max-request-output-tokens`` bounds ``n`` x the prompts' ``max_tokens``; on a head
    model the answer-budget floor raises a thinking request's ``max_tokens`` (to floor +
    cap, at most the rest of the context), so the check counts the raised value: a client
    could otherwise send ``max_tokens: 1`` and have each choice run to the context's end."""
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server
    from tests.support.head_models import save_head_model

    d = save_head_model(tmp_path / "m")
    env = {"LATENTSERVE_MAX_LATENT": "2", "LATENTSERVE_USE_STOP": "0",
           "LATENTSERVE_MIN_OUTPUT_TOKENS": "40"}
    srv = start_server(EngineConfig(model=str(d), max_num_seqs=4, max_model_len=256),
                       timeout=300, env=env, max_request_output_tokens=60)
    try:
        def post(path, body, headers=None):
            return httpx.post(f"{srv.base_url}{path}", timeout=60, headers=headers or {},
                              json={"max_tokens": 1, "temperature": 0, **body})

        prompt = {"prompt": [11, 12, 13]}
        chat = {"messages": [{"role": "user", "content": "hi"}]}
        # floor 40 + cap 2 = 42 per choice: n=2 is 84 > 60
        for path, body in (("/v1/completions", prompt), ("/v1/chat/completions", chat)):
            r = post(path, {**body, "n": 2})
            assert r.status_code == 400 and "max_tokens" in r.text, r.text
            assert post(path, {**body, "n": 1}).status_code == 200
            # the floor off, or thinking off: the client's max_tokens holds
            assert post(path, {**body, "n": 2, "min_output_tokens": 0}).status_code == 200
            assert post(path, {**body, "n": 2},
                        {"x-latent-thinking": "off"}).status_code == 200
        r = post("/v1/completions", {"prompt": [[11, 12], [13, 14]]})  # two prompts: 84
        assert r.status_code == 400, r.text
    finally:
        srv.stop()
