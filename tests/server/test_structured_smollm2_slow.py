"""Structured outputs on the real embedded SmolLM2-135M-Instruct, through the ``openai`` SDK
(issue 31): 100 JSON-schema answers sampled at temperature 1 all parse and validate;
``guided_choice`` and a regex likewise."""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import pytest

# Short strings and lists: the batch decodes until its longest answer ends.
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 12},
                         "hobbies": {"type": "array", "items": {"type": "string",
                                                                "maxLength": 10},
                                     "maxItems": 2},
                         "employed": {"type": "boolean"}},
          "required": ["name", "age", "city", "hobbies", "employed"]}
MESSAGES = [{"role": "user", "content": "Invent a person. Answer in JSON with name, age, city, "
                                        "hobbies and employed."}]


def _valid(v) -> bool:
    return (isinstance(v, dict) and set(v) == set(SCHEMA["required"])
            and isinstance(v["name"], str) and 1 <= len(v["name"]) <= 12
            and type(v["age"]) is int and 0 <= v["age"] <= 120
            and isinstance(v["city"], str) and len(v["city"]) <= 12
            and isinstance(v["hobbies"], list) and len(v["hobbies"]) <= 2
            and all(isinstance(h, str) and len(h) <= 10 for h in v["hobbies"])
            and isinstance(v["employed"], bool))


@pytest.fixture(scope="module")
def smollm2_client(smollm2_dir):
    import openai

    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    with start_server(EngineConfig(max_num_seqs=100, max_model_len=1024), timeout=600) as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused",
                               max_retries=0, timeout=600)
        yield client, client.models.list().data[0].id


def _many(client, model, n, **kw):
    def one(seed):
        r = client.chat.completions.create(model=model, messages=MESSAGES, temperature=1.0,
                                           seed=seed, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(n) as pool:  # all at once: one batch
        return list(pool.map(one, range(n)))


@pytest.mark.slow
def test_100_sampled_json_schema_answers_parse_and_validate(smollm2_client):
    client, model = smollm2_client
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA,
                                                  "strict": True}}
    outs = _many(client, model, 100, max_tokens=160, response_format=fmt)
    bad = [(t, r) for t, r in outs if r != "stop" or not _valid(json.loads(t))]
    assert not bad, bad[:3]
    assert len({t for t, _ in outs}) > 50  # sampled, not one answer


@pytest.mark.slow
def test_sampled_choices_and_regex_answers_hold(smollm2_client):
    client, model = smollm2_client
    choices = ["Paris", "London", "New York", "Tokyo"]
    for text, reason in _many(client, model, 20, max_tokens=16,
                              extra_body={"guided_choice": choices}):
        assert reason == "stop" and text in choices
    pattern = r"[A-Z][a-z]{2,10}, [0-9]{1,3} years"
    for text, reason in _many(client, model, 20, max_tokens=24,
                              extra_body={"guided_regex": pattern}):
        assert reason == "stop" and re.fullmatch(pattern, text), text
