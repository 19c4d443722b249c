"""Body fields the server does not implement are refused by name (never a 200 that ignored
them), and sampling values float32 cannot hold never reach the sampler; through the openai
SDK, as a vLLM client sends them (``extra_body``)."""

import openai
import pytest
from server_testlib import stand_in_app

MESSAGES = [{"role": "user", "content": "hi"}]

# vLLM's output-changing fields (and OpenAI's response_format) with a value that is used.
REFUSED = [
    ("guided_decoding_backend", "outlines"), ("guided_whitespace_pattern", " *"),
    ("prompt_embeds", "AAAA" * 100), ("use_beam_search", True),
    ("length_penalty", 0.5),
    ("logits_processors", ["x"]), ("spaces_between_special_tokens", False),
    ("documents", [{"title": "a", "text": "b"}]),
    ("reasoning_effort", "high"), ("priority", 5),
]


@pytest.mark.parametrize("field,value", REFUSED, ids=[f for f, _ in REFUSED])
def test_chat_refuses_an_unimplemented_field_by_name(client, model, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                       extra_body={field: value})
    error = info.value.body
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert f"{field} is not supported" in error["message"]
    assert len(error["message"]) < 200  # a large value is not echoed whole


@pytest.mark.parametrize("field,value", [*REFUSED, ("chat_template", "{{ 1 }}")],
                         ids=[*(f for f, _ in REFUSED), "chat_template"])
def test_completions_refuse_an_unimplemented_field_by_name(client, model, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", max_tokens=2, stream=True,
                                  extra_body={field: value})
    assert info.value.body["param"] == field


def test_unused_values_of_those_fields_are_served(client, model):
    """A client that sends the defaults (vLLM's for min_tokens, include_stop_str_in_output,
    bad_words; null for the rest) is served."""
    out = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, response_format={"type": "text"},
        extra_body={"min_tokens": 0, "include_stop_str_in_output": False, "bad_words": [],
                    "guided_json": None, "echo": False, "chat_template": None})
    assert out.choices[0].finish_reason in ("stop", "length")


SCHEMA = {"name": "x", "schema": {"type": "object"}}


@pytest.mark.parametrize("kind", ["text", "json_object"])
@pytest.mark.parametrize("route,body", [("/v1/chat/completions", {"messages": MESSAGES}),
                                        ("/v1/completions", {"prompt": "hi"})])
def test_a_json_schema_beside_another_response_format_type_is_a_400(smollm2_tokenizer, kind,
                                                                     route, body):
    """``response_format.json_schema`` constrains only under type json_schema; beside
    another type it would be ignored, so it is refused by its path (null is served)."""
    with stand_in_app(smollm2_tokenizer) as app:
        r = app.post(route, json={**body, "max_tokens": 2, "response_format": {
            "type": kind, "json_schema": SCHEMA}})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "response_format.json_schema"
        assert f"got type '{kind}'" in error["message"]
        ok = app.post(route, json={**body, "max_tokens": 2, "response_format": {
            "type": kind, "json_schema": None}})
        assert ok.status_code == 200, ok.text


def test_top_p_float32_flushes_to_zero_samples_the_greedy_text(client, model):
    greedy = client.completions.create(model=model, prompt="The capital of France is",
                                       max_tokens=6, temperature=0)
    tiny = client.completions.create(model=model, prompt="The capital of France is",
                                     max_tokens=6, temperature=1.0, top_p=1e-50, seed=1)
    assert tiny.choices[0].text == greedy.choices[0].text


@pytest.mark.parametrize("field,value", [("repetition_penalty", 1e-40),
                                         ("repetition_penalty", 1e39), ("temperature", 1e39)])
def test_values_float32_cannot_hold_are_a_400_naming_the_field(client, model, field, value):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                       **({field: value} if field == "temperature" else {}),
                                       extra_body={} if field == "temperature"
                                       else {field: value})
    assert info.value.body["param"] == field
    assert "3.4028234663852886e+38" in info.value.body["message"]
