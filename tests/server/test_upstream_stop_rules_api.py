"""``upstream_stop_rules`` over HTTP (issue 26): the body field reaches the engine on the
OpenAI routes and ``/v1/messages``; a model whose family has no upstream stop rule (here a
plain tiny Llama) answers ``true`` with a 400 naming the field and accepts ``false``. The
COCONUT side (the field changes the answer as upstream does) is in
``tests/server/test_latent_api.py`` and ``tests/parity/test_upstream_stop_rules.py``."""

import pytest
from server_testlib import assert_slots_invariant, wait_idle

MESSAGES = [{"role": "user", "content": "hi"}]


def _bodies(model, value):
    return {"/v1/completions": {"model": model, "prompt": "hi", "max_tokens": 2,
                                "upstream_stop_rules": value},
            "/v1/chat/completions": {"model": model, "messages": MESSAGES, "max_tokens": 2,
                                     "upstream_stop_rules": value},
            "/v1/messages": {"model": model, "messages": MESSAGES, "max_tokens": 2,
                             "upstream_stop_rules": value}}


def test_a_plain_model_refuses_true_naming_the_field(http, model):
    for route, body in _bodies(model, True).items():
        r = http.post(route, json=body)
        assert r.status_code == 400, (route, r.text)
        error = r.json()["error"]
        if route == "/v1/messages":  # Anthropic's field: reason form, no param
            assert error["message"].startswith("upstream_stop_rules: needs"), error
        else:
            assert error["message"].startswith("upstream_stop_rules needs"), (route, error)
            assert error["param"] == "upstream_stop_rules"
    # inside chat_template_kwargs, where routers keep the latent fields
    r = http.post("/v1/chat/completions", json={
        "model": model, "messages": MESSAGES, "max_tokens": 2,
        "chat_template_kwargs": {"upstream_stop_rules": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "upstream_stop_rules"
    assert_slots_invariant(wait_idle(http))


def test_a_plain_model_accepts_false(http, model):
    for route, body in _bodies(model, False).items():
        r = http.post(route, json=body)
        assert r.status_code == 200, (route, r.text)


def test_a_non_boolean_is_a_400_naming_it(http, model):
    r = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2,
                                           "upstream_stop_rules": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "upstream_stop_rules"


@pytest.mark.parametrize("value", [True, False, None])
def test_the_field_reaches_sampling_params_on_every_route(value):
    from types import SimpleNamespace

    from latentserve.server.anthropic_api import MessagesRequest, _Answer, _request_params
    from latentserve.server.params import sampling_params
    from latentserve.server.protocol import ChatCompletionRequest, CompletionRequest
    from latentserve.server.state import ServerLimits
    from latentserve.server.tools import ToolChoice

    state = SimpleNamespace(max_model_len=64, latent_spec=None, sampling_defaults=None,
                            reasoning_parser=None, tool_parser=None, tokenizer=None,
                            limits=ServerLimits())
    body = MessagesRequest(model="m", max_tokens=4, messages=MESSAGES,
                           upstream_stop_rules=value)
    answer = _Answer({}, ToolChoice("none"), None, None)
    assert _request_params(body, None, state, [5, 6, 7], answer).upstream_stop_rules is value
    for request in (CompletionRequest(prompt="hi", max_tokens=4, upstream_stop_rules=value),
                    ChatCompletionRequest(messages=MESSAGES, max_tokens=4,
                                          upstream_stop_rules=value)):
        params = sampling_params(request, "max_tokens", 3, state)
        assert params.upstream_stop_rules is value
