"""The one declaration of each route's fields (``server/fields.py``): docs/server.md's table
is generated from it, every field it refuses is a 400 naming the field on the live server,
and every field it calls implemented is one the route's request model validates."""

from pathlib import Path

import anthropic
import openai
import pytest
from server_testlib import API_KEY

from latentserve.server import fields

DOC = Path(__file__).resolve().parents[2] / "docs" / "server.md"
# A value no refused field serves (each serves null and its defaults only).
USED = 2


def test_docs_field_table_matches_the_declaration():
    doc = DOC.read_text(encoding="utf-8")
    assert fields.with_table(doc) == doc, "run scripts/gen_field_table.py"


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
