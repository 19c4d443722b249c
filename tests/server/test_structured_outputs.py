"""Structured outputs through the real ``openai`` SDK against a live server on the tiny
random Llama with SmolLM2's tokenizer: ``response_format`` (``json_schema``,
``json_object``), vLLM's ``guided_*`` fields and ``structured_outputs`` object, streamed and
not; malformed constraints are 400s naming the field; unconstrained requests batched with
constrained ones keep their exact greedy outputs. (The same on the real SmolLM2, 100
sampled requests: test_structured_smollm2_slow.py.)"""

import json
import re
import threading

import openai
import pytest

MESSAGES = [{"role": "user", "content": "Describe a person as JSON."}]
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "items": {"enum": ["cat", "dog"]},
                                  "maxItems": 3},
                         "ok": {"type": "boolean"}},
          "required": ["name", "age", "pets", "ok"]}


def valid_person(value) -> bool:
    """Whether ``value`` satisfies ``SCHEMA`` (strict: no other properties)."""
    return (isinstance(value, dict) and set(value) == {"name", "age", "pets", "ok"}
            and isinstance(value["name"], str) and 1 <= len(value["name"]) <= 8
            and type(value["age"]) is int and 0 <= value["age"] <= 120
            and isinstance(value["pets"], list) and len(value["pets"]) <= 3
            and all(p in ("cat", "dog") for p in value["pets"])
            and isinstance(value["ok"], bool))


def _chat_text(client, model, stream, **kw):
    if not stream:
        r = client.chat.completions.create(model=model, messages=MESSAGES, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = "", None
    for c in client.chat.completions.create(model=model, messages=MESSAGES, stream=True,
                                            **kw):
        for ch in c.choices:
            text += ch.delta.content or ""
            reason = ch.finish_reason or reason
    return text, reason


JSON_SCHEMA_FORMAT = {"type": "json_schema",
                      "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_response_parses_and_validates(client, model, stream):
    for seed in range(4):
        text, reason = _chat_text(client, model, stream, max_tokens=80, temperature=1.0,
                                  seed=seed, response_format=JSON_SCHEMA_FORMAT)
        assert reason == "stop", text
        assert valid_person(json.loads(text)), text


def test_n_choices_each_follow_the_schema(client, model):
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=80,
                                       temperature=1.0, n=3, seed=7,
                                       response_format=JSON_SCHEMA_FORMAT)
    assert len({c.message.content for c in r.choices}) > 1
    for c in r.choices:
        assert valid_person(json.loads(c.message.content)), c.message.content


def test_the_sdks_parse_helper_gets_a_parsed_pydantic_object(client, model):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        kind: Literal["cat", "dog"]
        age: int = Field(ge=0, le=30)

    r = client.chat.completions.parse(model=model, messages=MESSAGES, max_tokens=60,
                                      temperature=1.0, seed=1, response_format=Pet)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("body,check", [
    ({"guided_choice": ["red", "green", "light blue"]},
     lambda t: t in ("red", "green", "light blue")),
    ({"guided_regex": r"[0-9]{3}-[a-z]{2,4}"},
     lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    ({"guided_json": SCHEMA}, lambda t: valid_person(json.loads(t))),
    ({"guided_json": json.dumps(SCHEMA)}, lambda t: valid_person(json.loads(t))),
    ({"guided_grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),
    ({"guided_grammar": 'start: ("up" | "down") " " NUMBER\nNUMBER: /[0-9]/'},
     lambda t: re.fullmatch(r"(up|down) [0-9]", t)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"regex": "[a-c]{4}"}}, lambda t: re.fullmatch("[a-c]{4}", t)),
    ({"structured_outputs": {"json": SCHEMA}}, lambda t: valid_person(json.loads(t))),
], ids=["guided_choice", "guided_regex", "guided_json", "guided_json_str", "guided_ebnf",
        "guided_lark", "so_choice", "so_regex", "so_json"])
def test_guided_fields_hold(client, model, stream, body, check):
    for seed in range(3):
        text, reason = _chat_text(client, model, stream, max_tokens=80, temperature=1.0,
                                  seed=seed, extra_body=body)
        assert reason == "stop" and check(text), text


@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_the_same_fields(client, model, stream):
    kw = dict(model=model, prompt="Pick a color:", max_tokens=20, temperature=1.0, seed=2,
              extra_body={"guided_choice": ["red", "green"]})
    if stream:
        text = "".join(ch.text for c in client.completions.create(stream=True, **kw)
                       for ch in c.choices)
    else:
        text = client.completions.create(**kw).choices[0].text
    assert text in ("red", "green")
    r = client.completions.create(model=model, prompt="JSON:", max_tokens=80, temperature=1.0,
                                  seed=3, extra_body={"response_format": JSON_SCHEMA_FORMAT})
    assert valid_person(json.loads(r.choices[0].text))


def test_json_object_gives_an_object(client, model):
    # A random model's object may grow past max_tokens; what finishes parses as an object.
    for seed in range(4):
        text, reason = _chat_text(client, model, False, max_tokens=60, temperature=1.0,
                                  seed=seed, response_format={"type": "json_object"})
        assert text.startswith("{")
        if reason == "stop":
            assert isinstance(json.loads(text), dict)


def test_response_format_text_is_no_constraint(client, model):
    a = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8,
                                       temperature=0, response_format={"type": "text"})
    b = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8,
                                       temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content


@pytest.mark.parametrize("body,field", [
    ({"guided_json": {"type": "foo"}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),  # not JSON
    ({"structured_outputs": {"whitespace_pattern": "x"}},
     "structured_outputs.whitespace_pattern"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_json": {"type": "object"}, "guided_regex": "b"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_a_malformed_constraint_is_a_400_naming_the_field(client, model, body, field, stream):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8,
                                       stream=stream, extra_body=body)
    assert info.value.body["param"] == field, info.value.body


def test_unconstrained_requests_batched_with_constrained_ones_are_unchanged(client, model):
    prompts = ["The capital of France is", "Once upon a time", "1, 2, 3,"]
    greedy = dict(model=model, max_tokens=16, temperature=0, extra_body={"ignore_eos": True})
    alone = [client.completions.create(prompt=p, **greedy).choices[0].text for p in prompts]
    results: dict = {}

    def plain(i):
        results[i] = client.completions.create(prompt=prompts[i], **greedy).choices[0].text

    def constrained(i):
        extra = ({"guided_json": SCHEMA}, {"guided_regex": "[a-z ]{5,20}"},
                 {"guided_choice": ["x", "y"]})[i % 3]
        results[("c", i)] = client.completions.create(
            model=model, prompt=prompts[i % 3], max_tokens=40, temperature=1.0, seed=i,
            extra_body=extra).choices[0].text

    threads = [threading.Thread(target=f, args=(i,)) for i in range(3)
               for f in (plain, constrained)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(3)] == alone
    assert results[("c", 2)] in ("x", "y")


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_output_config_format_parses_and_validates(anthropic_client, model, stream):
    """Anthropic's structured outputs: ``output_config.format`` is a JSON schema."""
    fmt = {"output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}
    for _ in range(3):
        args = dict(model=model, max_tokens=80, messages=MESSAGES,
                    extra_body={"temperature": 1.0}, **fmt)
        if stream:
            with anthropic_client.messages.stream(**args) as s:
                m = s.get_final_message()
        else:
            m = anthropic_client.messages.create(**args)
        assert m.stop_reason == "end_turn", m
        assert valid_person(json.loads(m.content[0].text)), m.content


@pytest.mark.parametrize("config, param", [
    ({"format": {"type": "json_object"}}, "output_config.format"),
    ({"format": {"type": "json_schema", "schema": "{}"}}, "output_config.format"),
    ({"format": {"type": "json_schema", "schema": {"type": "nonsense"}}},
     "output_config.format"),
    ({"effort": "high"}, "output_config.effort")])
def test_anthropic_output_config_refusals_name_the_field(anthropic_client, model, config,
                                                         param):
    import anthropic

    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.create(model=model, max_tokens=4, messages=MESSAGES,
                                         output_config=config)
    assert info.value.body["error"]["message"].startswith(param), info.value.body
