"""The one declaration of each route's fields (``server/fields.py``): docs/server.md's table
is generated from it, every field it refuses is a 400 naming the field on the live server,
every field it calls implemented is one the route's request model validates, every field
the installed openai / anthropic SDK sends is declared, and any other top-level field is a
400 naming it in the route's protocol."""

import importlib.util
from pathlib import Path

import anthropic
import openai
import pytest
from server_testlib import API_KEY

from latentserve.server import fields

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "server.md"
# A value no refused field serves (each serves null and its defaults only).
USED = 2


def test_docs_field_table_matches_the_declaration():
    spec = importlib.util.spec_from_file_location("gen_field_table",
                                                  ROOT / "scripts" / "gen_field_table.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    doc = DOC.read_text(encoding="utf-8")
    assert gen.with_table(doc) == doc, "run scripts/gen_field_table.py"


def test_accepted_fields_are_fields_of_the_route_model():
    for route, names in fields.ACCEPTED.items():
        assert set(names) <= set(fields.request_model(route).model_fields), route


def test_no_field_is_both_implemented_and_refused():
    for route in fields.ROUTES:
        assert not set(fields.implemented(route)) & set(fields.refused(route)), route


def test_chat_implements_vllm_chat_template_and_echo():
    assert {"chat_template", "echo"} <= set(fields.implemented("/v1/chat/completions"))
    assert "chat_template" in fields.refused("/v1/completions")


def _refused(route):
    return [(route, name) for name in sorted(fields.refused(route))]


@pytest.mark.parametrize("route,name", _refused("/v1/completions")
                         + _refused("/v1/chat/completions"))
def test_every_declared_openai_refusal_is_a_400_naming_the_field(server, model, route, name):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        if route == "/v1/completions":
            client.completions.create(model=model, prompt="hi", max_tokens=1,
                                      extra_body={name: USED})
        else:
            client.chat.completions.create(model=model, max_tokens=1, extra_body={name: USED},
                                           messages=[{"role": "user", "content": "hi"}])
    assert info.value.body["param"] == name
    assert f"{name} is not supported" in info.value.body["message"]


@pytest.mark.parametrize("name", sorted(fields.refused("/v1/messages")))
def test_every_declared_anthropic_refusal_is_a_400_naming_the_field(server, model, name):
    client = anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as info:
        client.messages.create(model=model, max_tokens=1, extra_body={name: USED},
                               messages=[{"role": "user", "content": "hi"}])
    body = info.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert f"{name}: not supported" in body["error"]["message"]  # Anthropic's field: reason


def _sdk_fields(params) -> set[str]:
    """The body fields of an SDK's ``TypedDict`` of request params."""
    return set(params.__required_keys__) | set(params.__optional_keys__)


# The SDKs' params that they send as headers, not in the body.
_HEADERS = {"betas", "user_profile_id", "workspace_id"}


@pytest.mark.parametrize("route,params", [
    ("/v1/completions", "openai.types.completion_create_params.CompletionCreateParamsBase"),
    ("/v1/chat/completions",
     "openai.types.chat.completion_create_params.CompletionCreateParamsBase"),
    ("/v1/messages", "anthropic.types.message_create_params.MessageCreateParamsBase"),
    ("/v1/messages", "anthropic.types.beta.message_create_params.MessageCreateParamsBase"),
    ("/v1/messages", "anthropic.types.message_count_tokens_params.MessageCountTokensParams"),
    ("/v1/messages",
     "anthropic.types.beta.message_count_tokens_params.MessageCountTokensParams"),
])
def test_every_sdk_request_field_is_declared(route, params):
    """Each field the installed openai / anthropic SDK can send is implemented, accepted or
    refused by name (so a real client never gets ``unknown_field``)."""
    import importlib

    module, name = params.rsplit(".", 1)
    sdk = _sdk_fields(getattr(importlib.import_module(module), name)) - _HEADERS
    declared = set(fields.implemented(route)) | set(fields.ACCEPTED[route]) \
        | set(fields.refused(route))
    assert sdk - declared == set(), route


UNKNOWN = "temprature"
OPENAI_UNKNOWN = {"message": f"Unrecognized request argument supplied: {UNKNOWN}",
                  "type": "invalid_request_error", "param": UNKNOWN, "code": "unknown_field"}


def test_openai_routes_refuse_an_unknown_field_by_name(client, model):
    calls = [
        lambda: client.completions.create(model=model, prompt="hi", max_tokens=1,
                                          extra_body={UNKNOWN: 0.5}),
        lambda: client.completions.create(model=model, prompt="hi", max_tokens=1,
                                          stream=True, extra_body={UNKNOWN: 0.5}),
        lambda: client.chat.completions.create(model=model, max_tokens=1,
                                               extra_body={UNKNOWN: 0.5},
                                               messages=[{"role": "user", "content": "hi"}]),
    ]
    for call in calls:
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.body == OPENAI_UNKNOWN


@pytest.mark.parametrize("path,body", [("/tokenize", {"prompt": "hi"}),
                                       ("/detokenize", {"tokens": [1]})])
def test_tokenize_routes_refuse_an_unknown_field_by_name(http, path, body):
    r = http.post(path, json={**body, UNKNOWN: 0.5})
    assert r.status_code == 400 and r.json() == {"error": OPENAI_UNKNOWN}
    ok = http.post(path, json=body)
    assert ok.status_code == 200, ok.text


def test_every_unknown_field_is_named_at_once(http):
    r = http.post("/tokenize", json={"prompt": "hi", UNKNOWN: 0.5, "no_such_field": 1})
    assert r.status_code == 400 and r.json()["error"] == {
        **OPENAI_UNKNOWN, "message": "Unrecognized request arguments supplied: "
                                     f"{UNKNOWN}, no_such_field"}


def test_sglang_router_fields_at_their_defaults_are_served(http, model):
    """sglang-router forwards SGLang's extensions at their defaults; other values are
    refused by name."""
    body = {"model": model, "prompt": "hi", "max_tokens": 1, "no_stop_trim": False,
            "return_hidden_states": False, "separate_reasoning": True,
            "stream_reasoning": True}
    assert http.post("/v1/completions", json=body).status_code == 200
    r = http.post("/v1/completions", json={**body, "return_hidden_states": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "return_hidden_states"


def test_anthropic_routes_refuse_an_unknown_field_by_name(anthropic_client, model):
    messages = [{"role": "user", "content": "hi"}]
    calls = [
        lambda: anthropic_client.messages.create(model=model, max_tokens=1, messages=messages,
                                                 extra_body={UNKNOWN: 0.5}),
        lambda: anthropic_client.messages.count_tokens(model=model, messages=messages,
                                                       extra_body={UNKNOWN: 0.5}),
    ]
    for call in calls:
        with pytest.raises(anthropic.BadRequestError) as info:
            call()
        assert info.value.body == {"type": "error", "error": {
            "type": "invalid_request_error",
            "message": f"{UNKNOWN}: Extra inputs are not permitted"}}


# A value for each accepted field, as a client would send it.
ACCEPTED_VALUES = {
    "user": "u-1", "metadata": {"user_id": "u-1"}, "store": True, "service_tier": "auto",
    "safety_identifier": "s-1", "prompt_cache_key": "k-1", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"ttl": "1h"}, "prediction": {"type": "content", "content": "hi"},
    "inference_geo": "us", "cache_control": {"type": "ephemeral"}, "speed": "standard",
    "billing_policy": {"type": "billing_policy", "bill_to": "self"},
    "fallback_credit_token": "tok",
}


def _accepted(route) -> dict:
    return {name: ACCEPTED_VALUES[name] for name in fields.ACCEPTED[route]}


def test_a_request_with_every_accepted_field_is_served(client, anthropic_client, model):
    """Every accepted field at once (``ACCEPTED_VALUES`` covers them all) changes nothing:
    the greedy answer is the one without them."""
    messages = [{"role": "user", "content": "hi"}]
    oa, an = client, anthropic_client
    for route, call in [
        ("/v1/completions", lambda extra: oa.completions.create(
            model=model, prompt="hi", max_tokens=3, temperature=0,
            extra_body=extra).choices[0].text),
        ("/v1/chat/completions", lambda extra: oa.chat.completions.create(
            model=model, max_tokens=3, temperature=0, messages=messages,
            extra_body=extra).choices[0].message.content),
    ]:
        assert call(_accepted(route)) == call({}), route
    greedy = {"temperature": 0.0, "top_k": 1}

    def message(extra):
        return an.messages.create(model=model, max_tokens=3, messages=messages,
                                  extra_body={**greedy, **extra}).content[0].text

    assert message(_accepted("/v1/messages")) == message({})
    counted = {k: v for k, v in _accepted("/v1/messages").items()
               if k not in fields.NOT_COUNTED}  # the others are refused there, as Anthropic's
    assert an.messages.count_tokens(model=model, messages=messages,
                                    extra_body=counted).input_tokens > 0
