"""Latent budgets through the HTTP API (issue 5): a COCONUT checkpoint served over the
OpenAI routes; the body field and the ``x-latent-budget`` header set each request's budget,
bad budgets get 400s, and answers equal the eager per-request reference."""

import json

import httpx
import pytest
from server_testlib import assert_slots_invariant, wait_idle


@pytest.fixture(scope="module")
def coconut_dir(tmp_path_factory, smollm2_dir):
    from latentserve.bench.baseline.latent_models import save_latent_tiny

    return save_latent_tiny(tmp_path_factory.mktemp("latent-api"), "coconut-llama",
                            max_budget=8)


@pytest.fixture(scope="module")
def latent_server(coconut_dir):
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    srv = start_server(EngineConfig(model=str(coconut_dir), max_num_seqs=8), timeout=300)
    yield srv
    srv.stop()


PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]


def _complete(srv, body=None, headers=None):
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, **(body or {})}
    return httpx.post(f"{srv.base_url}/v1/completions", json=body, headers=headers or {},
                      timeout=60)


@pytest.mark.parametrize("budget", [0, 2, 5])
def test_body_budget_runs_that_many_latent_steps_and_matches_reference(budget, latent_server,
                                                                        coconut_dir):
    from latentserve.models.checkpoint import load_tokenizer
    from tests.support.latent_reference import reference_generate

    r = _complete(latent_server, {"latent_budget": budget})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    # ``latent`` is null when no latent step ran and no trace was asked for.
    assert (choice["latent"] or {"steps": 0})["steps"] == budget
    ref, _ = reference_generate(coconut_dir, PROMPT, budget, 6)
    tok = load_tokenizer(coconut_dir)
    eos = tok.eos_token_id
    ref_text = tok.decode([t for t in ref if t != eos], skip_special_tokens=True)
    assert choice["text"] == ref_text


@pytest.mark.parametrize("upstream", [True, False])
def test_upstream_stop_rules_reaches_the_engine(upstream, latent_server, coconut_dir):
    """COCONUT takes the field (the edge it changes is in tests/parity/
    test_upstream_stop_rules.py); the answer equals the reference of that rule."""
    from latentserve.models.checkpoint import load_tokenizer
    from tests.support.latent_reference import reference_generate

    r = _complete(latent_server, {"latent_budget": 2, "upstream_stop_rules": upstream})
    assert r.status_code == 200, r.text
    ref, _ = reference_generate(coconut_dir, PROMPT, 2, 6, upstream_stop_rules=upstream)
    text = load_tokenizer(coconut_dir).decode(ref, skip_special_tokens=True)
    assert r.json()["choices"][0]["text"] == text


def test_header_overrides_body(latent_server):
    r = _complete(latent_server, {"latent_budget": 1}, {"x-latent-budget": "4"})
    assert r.status_code == 200 and r.json()["choices"][0]["latent"]["steps"] == 4


def test_trace_reports_norm_and_top5_per_step(latent_server):
    r = httpx.post(f"{latent_server.base_url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0,
        "latent_budget": 3, "return_latent_trace": True})
    assert r.status_code == 200, r.text
    latent = r.json()["choices"][0]["latent"]
    assert latent["steps"] == 3 and len(latent["trace"]) == 3
    for step in latent["trace"]:
        assert step["norm"] > 0 and len(step["top_tokens"]) == 5
    r = httpx.post(f"{latent_server.base_url}/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 2, "latent_budget": 0, "return_latent_trace": True})
    assert r.json()["choices"][0]["latent"] == {"steps": 0, "trace": [], "stats": None,
                                                "recurrence": None}  # a list, as asked


def test_chat_takes_latent_fields_inside_chat_template_kwargs(latent_server):
    """What a router that rebuilds the OpenAI body keeps (sglang-router drops unknown
    top-level fields and x- headers): the fields inside ``chat_template_kwargs``; a
    top-level field wins; a bad value is a 400 naming where it was."""
    url = f"{latent_server.base_url}/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "temperature": 0}
    r = httpx.post(url, timeout=60, json={
        **body, "chat_template_kwargs": {"latent_budget": 3, "return_latent_trace": True}})
    assert r.status_code == 200, r.text
    latent = r.json()["choices"][0]["latent"]
    assert latent["steps"] == 3 and len(latent["trace"]) == 3
    r = httpx.post(url, timeout=60, json={**body, "latent_budget": 1,
                                          "chat_template_kwargs": {"latent_budget": 3}})
    assert r.status_code == 200 and r.json()["choices"][0]["latent"]["steps"] == 1
    for bad, param in (({"latent_budget": "3"}, "chat_template_kwargs.latent_budget"),
                       ({"latent_budget": 99}, "latent_budget")):
        r = httpx.post(url, timeout=60, json={**body, "chat_template_kwargs": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("body,headers,param", [
    ({"latent_budget": 9}, None, "latent_budget"),          # above the model's cap of 8
    ({"latent_budget": -1}, None, "latent_budget"),
    ({"latent_budget": 2.5}, None, "latent_budget"),
    ({"latent_budget": "3"}, None, "latent_budget"),
    (None, {"x-latent-budget": "two"}, "x-latent-budget"),
    (None, {"x-latent-budget": "-3"}, "x-latent-budget"),
])
def test_bad_budget_is_a_400_naming_it_and_the_server_goes_on(body, headers, param,
                                                              latent_server):
    r = _complete(latent_server, body, headers)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"]
    assert _complete(latent_server, {"latent_budget": 1}).status_code == 200
    with httpx.Client(base_url=latent_server.base_url) as http:
        assert_slots_invariant(wait_idle(http))


def test_thinking_off_runs_no_latent_step_on_every_route(latent_server, coconut_dir):
    """Body ``thinking: false``, its header, template kwargs and Anthropic's disabled
    thinking block each run no latent step; beside a budget above 0 it is a 400."""
    base = latent_server.base_url
    msgs = [{"role": "user", "content": "hi"}]
    chat = {"messages": msgs, "max_tokens": 3, "temperature": 0}
    for path, body, headers in (
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3, "thinking": False}, {}),
            ("/v1/completions", {"prompt": PROMPT, "max_tokens": 3},
             {"x-latent-thinking": "off"}),
            ("/v1/chat/completions", {**chat, "thinking": False}, {}),
            ("/v1/chat/completions", {**chat, "chat_template_kwargs": {"enable_thinking": False}},
             {})):
        r = httpx.post(base + path, json=body, headers=headers, timeout=60)
        assert r.status_code == 200, (path, body, r.text)
        assert r.json()["choices"][0]["latent"] is None  # no latent step ran
    r = httpx.post(base + "/v1/messages", timeout=60, json={
        "model": str(coconut_dir), "max_tokens": 3, "messages": msgs,
        "thinking": {"type": "disabled"}})
    assert r.status_code == 200, r.text
    assert not [b for b in r.json()["content"] if b["type"] == "thinking"]
    r = httpx.post(base + "/v1/chat/completions", timeout=60,
                   json={**chat, "chat_template_kwargs": {"enable_thinking": 0}})
    assert r.status_code == 400, r.text  # 0 is no boolean: refused, not ignored
    assert r.json()["error"]["param"] == "chat_template_kwargs.enable_thinking"
    r = _complete(latent_server, {"thinking": False, "latent_budget": 2})
    assert r.status_code == 400 and "latent_budget is 2" in r.json()["error"]["message"]
    # thinking on is the default: taken, as the template's and Anthropic's switch are
    on = [_complete(latent_server, {"thinking": True}),
          _complete(latent_server, {}, {"x-latent-thinking": "on"}), _complete(latent_server)]
    assert [r.status_code for r in on] == [200] * 3, on[0].text
    assert len({r.json()["choices"][0]["latent"]["steps"] for r in on}) == 1
    card = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["latent"]
    assert card["controls"] == ["latent_budget", "thinking", "upstream_stop_rules"]
    with httpx.Client(base_url=base) as http:
        assert_slots_invariant(wait_idle(http))


def test_latent_steps_are_counted_in_the_metrics(latent_server):
    def total():
        text = httpx.get(f"{latent_server.base_url}/metrics", timeout=30).text
        return float(next(x for x in text.splitlines()
                          if x.startswith("latentserve_latent_steps_total")).rsplit(" ", 1)[1])

    before = total()
    assert _complete(latent_server, {"latent_budget": 3}).status_code == 200
    assert _complete(latent_server, {"latent_budget": 0}).status_code == 200
    assert total() == before + 3


def test_messages_route_takes_the_budget_too(latent_server, coconut_dir):
    body = {"model": str(coconut_dir), "max_tokens": 3,
            "messages": [{"role": "user", "content": "hi"}]}
    ok = httpx.post(f"{latent_server.base_url}/v1/messages", json=body, timeout=60,
                    headers={"x-latent-budget": "2"})
    assert ok.status_code == 200, ok.text
    bad = httpx.post(f"{latent_server.base_url}/v1/messages", json={**body, "latent_budget": 99},
                     timeout=60)
    assert bad.status_code == 400 and "latent_budget" in bad.text


def test_plain_model_refuses_a_budget_on_every_route(server, model):
    from server_testlib import API_KEY

    headers = {"Authorization": f"Bearer {API_KEY}", "x-latent-budget": "3"}
    msgs = [{"role": "user", "content": "hi"}]
    for path, body in (("/v1/chat/completions", {"messages": msgs, "max_tokens": 2}),
                       ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                       ("/v1/messages", {"model": model, "messages": msgs, "max_tokens": 2})):
        r = httpx.post(server.base_url + path, json=body, headers=headers, timeout=60)
        assert r.status_code == 400 and "no latent reasoning" in r.text, (path, r.text)
        assert "x-latent-budget" in r.text  # the header is named, not the body field


def _sse(srv, path, body, headers=None) -> list[dict]:
    """Every JSON event of a streamed request."""
    events = []
    with httpx.stream("POST", f"{srv.base_url}{path}", json={**body, "stream": True},
                      headers=headers or {}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    return events


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0,
        "latent_budget": 3, "return_latent_trace": True}


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", CHAT),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0,
                         "latent_budget": 3, "return_latent_trace": True}),
])
def test_streamed_finish_chunk_carries_the_same_latent_field(latent_server, path, body):
    whole = httpx.post(f"{latent_server.base_url}{path}", json=body, timeout=60)
    want = whole.json()["choices"][0]["latent"]
    assert want["steps"] == 3 and len(want["trace"]) == 3
    choices = [c for e in _sse(latent_server, path, body) for c in e["choices"]]
    finish = [c for c in choices if c["finish_reason"]]
    assert len(finish) == 1 and finish[0]["latent"] == want
    # Only the finish chunk carries it (chat leaves the field out, completions send null).
    assert all(c.get("latent") is None for c in choices if not c["finish_reason"])


@pytest.mark.parametrize("ask", [{"stream_latent_steps": True},
                                 {"headers": {"x-latent-stream-steps": "1"}}])
def test_one_reasoning_line_per_latent_step_when_ticks_are_asked(latent_server, ask):
    fields = {k: v for k, v in ask.items() if k != "headers"}
    body = {**CHAT, "latent_budget": 4, **fields}
    headers = ask.get("headers")
    events = _sse(latent_server, "/v1/chat/completions", body, headers)
    deltas = [c["delta"] for e in events for c in e["choices"]]
    ticks = [d for d in deltas if "reasoning_content" in d]
    assert [d["reasoning_content"] for d in ticks] == [f"[step {k}]\n" for k in (1, 2, 3, 4)]
    # The ticks come before any answer text.
    first_text = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert max(deltas.index(t) for t in ticks) < first_text
    plain = _sse(latent_server, "/v1/chat/completions", {**CHAT, "latent_budget": 4})
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert text == "".join(c["delta"].get("content") or "" for e in plain
                           for c in e["choices"])


def _reasoning_deltas(events) -> tuple[list[str], int]:
    """The streamed reasoning_content pieces and whether they all precede the answer."""
    deltas = [c["delta"] for e in events for c in e["choices"]]
    pieces = [(i, d["reasoning_content"]) for i, d in enumerate(deltas)
              if d.get("reasoning_content")]
    first_text = next(i for i, d in enumerate(deltas) if d.get("content"))
    return [p for _, p in pieces], all(i < first_text for i, _ in pieces)


def test_reasoning_content_counts_the_latent_steps(latent_server):
    r = httpx.post(f"{latent_server.base_url}/v1/chat/completions", timeout=60,
                   json={**CHAT, "return_latent_trace": False})
    assert r.json()["choices"][0]["message"]["reasoning_content"] == "[3 latent steps]"
    pieces, before = _reasoning_deltas(_sse(latent_server, "/v1/chat/completions",
                                            {**CHAT, "return_latent_trace": False}))
    assert pieces == ["[3 latent steps]"] and before


def _logit_lens_lines(coconut_dir, trace) -> list[str]:
    """What latent_reasoning "logit_lens" writes for a trace: each step's top 3 tokens."""
    from latentserve.models.checkpoint import load_tokenizer
    from latentserve.server.logprobs import TokenTexts

    texts = TokenTexts(load_tokenizer(coconut_dir))
    return [f"[step {k}: " + ", ".join(json.dumps(texts.text(t), ensure_ascii=False)
                                       for t, _ in step["top_tokens"][:3]) + "]\n"
            for k, step in enumerate(trace, 1)]


def test_logit_lens_reasoning_decodes_each_steps_top_tokens(latent_server, coconut_dir):
    body = {**CHAT, "latent_reasoning": "logit_lens"}
    r = httpx.post(f"{latent_server.base_url}/v1/chat/completions", timeout=60, json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lines = _logit_lens_lines(coconut_dir, choice["latent"]["trace"])
    assert len(lines) == 3 and choice["message"]["reasoning_content"] == "".join(lines)
    pieces, before = _reasoning_deltas(_sse(latent_server, "/v1/chat/completions", body))
    assert pieces == lines and before  # one delta per step, as it runs


@pytest.mark.parametrize("stream", [False, True])
def test_messages_thinking_block_renders_the_latent_steps(latent_server, coconut_dir, stream):
    import anthropic

    claude = anthropic.Anthropic(base_url=latent_server.base_url, api_key="none",
                                 max_retries=0, timeout=60)
    args = {"model": str(coconut_dir), "max_tokens": 4, "messages": CHAT["messages"],
            "thinking": {"type": "enabled", "budget_tokens": 1024},
            "extra_body": {"temperature": 0, "latent_budget": 3,
                           "latent_reasoning": "logit_lens", "return_latent_trace": True}}
    if stream:
        with claude.messages.stream(**args) as s:
            msg = s.get_final_message()
        latent = None
    else:
        raw = claude.messages.with_raw_response.create(**args)
        msg, latent = raw.parse(), raw.http_response.json()["latent"]
    assert [b.type for b in msg.content] == ["thinking", "text"]
    if latent is not None:
        assert msg.content[0].thinking == "".join(_logit_lens_lines(coconut_dir,
                                                                    latent["trace"]))
    assert msg.content[0].thinking.count("[step ") == 3
    count = claude.messages.create(**{**args, "extra_body": {"temperature": 0,
                                                             "latent_budget": 3}})
    assert count.content[0].thinking == "[3 latent steps]"


def test_malformed_tick_header_is_a_400_naming_it(latent_server):
    r = httpx.post(f"{latent_server.base_url}/v1/chat/completions", timeout=60,
                   json={**CHAT, "stream": True}, headers={"x-latent-stream-steps": "maybe"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "x-latent-stream-steps"
