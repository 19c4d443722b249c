"""Reasoning output of a ``<think>`` model (issue 31): the scripted chat model of conftest.py
writes ``<think>...</think>`` when its template's ``enable_thinking`` is on, and the server's
``--reasoning-parser qwen3`` splits it into ``reasoning_content`` (OpenAI) or a ``thinking``
block (Anthropic), whole and streamed alike."""

import json

import anthropic
import httpx
import openai
import pytest
from server_testlib import stand_in_app

HI = [{"role": "user", "content": "Hi!"}]
REASONING, ANSWER = "\nThe user greets me.\n", "\n\nHello!"
THINK = {"chat_template_kwargs": {"enable_thinking": True}}


@pytest.fixture
def client(tool_chat_server):
    return openai.OpenAI(base_url=f"{tool_chat_server.base_url}/v1", api_key="none",
                         max_retries=0, timeout=120)


@pytest.fixture
def model(tool_chat_dir):
    return str(tool_chat_dir)


def test_think_text_goes_to_reasoning_content(client, model):
    r = client.chat.completions.create(model=model, messages=HI, temperature=0,
                                       max_tokens=20, extra_body=THINK)
    message = r.choices[0].message
    assert message.reasoning_content == message.reasoning == REASONING  # vLLM's both names
    assert message.content == ANSWER
    assert r.choices[0].finish_reason == "stop"


def test_streamed_think_text_arrives_as_reasoning_deltas_before_the_answer(
        tool_chat_server, model):
    with httpx.stream("POST", f"{tool_chat_server.base_url}/v1/chat/completions",
                      timeout=120, json={"model": model, "messages": HI, "temperature": 0,
                                         "stream": True, **THINK}) as r:
        deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                  if line.startswith("data: {")]
    reasoning = [d["reasoning_content"] for d in deltas if d.get("reasoning_content")]
    assert reasoning == [d["reasoning"] for d in deltas if d.get("reasoning")]
    content = [d["content"] for d in deltas if d.get("content")]
    assert "".join(reasoning) == REASONING and "".join(content) == ANSWER
    first_answer = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all(i < first_answer for i, d in enumerate(deltas) if d.get("reasoning_content"))
    assert not any("<think>" in (d.get("content") or "") for d in deltas)


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_token_budget_cuts_the_reasoning_and_closes_it(tool_chat_server, model,
                                                                 stream):
    """Budget 1: ``<think>``, one reasoning token, then ``</think>`` forced (vLLM's field)."""
    body = {"model": model, "messages": HI, "temperature": 0, "max_tokens": 20, **THINK,
            "thinking_token_budget": 1}
    url = f"{tool_chat_server.base_url}/v1/chat/completions"
    if stream:
        with httpx.stream("POST", url, timeout=120, json={**body, "stream": True}) as r:
            deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.iter_lines()
                      if line.startswith("data: {")]
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
    else:
        r = httpx.post(url, timeout=120, json=body)
        assert r.status_code == 200, r.text
        reasoning = r.json()["choices"][0]["message"]["reasoning_content"]
    assert reasoning == REASONING.rstrip("\n")


def test_thinking_token_budget_without_a_reasoning_parser_is_a_400(scripted_http,
                                                                     scripted_model_dir):
    r = scripted_http.post("/v1/completions", json={
        "model": str(scripted_model_dir), "prompt": "Hi", "max_tokens": 2,
        "thinking_token_budget": 4})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "thinking_token_budget"
    assert err["message"].startswith("thinking_token_budget needs a model that reasons")


def test_include_reasoning_false_drops_the_reasoning(client, model):
    r = client.chat.completions.create(model=model, messages=HI, temperature=0,
                                       max_tokens=20,
                                       extra_body={**THINK, "include_reasoning": False})
    assert r.choices[0].message.reasoning_content is None
    assert r.choices[0].message.content == ANSWER


def test_an_answer_without_think_tags_is_all_content_under_qwen3(client, model):
    r = client.chat.completions.create(model=model, messages=[
        {"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."},
        {"role": "tool", "tool_call_id": "x", "content": "18C"}], temperature=0,
        max_tokens=20)
    assert r.choices[0].message.reasoning_content is None
    assert r.choices[0].message.content == "It is 18C in Paris."


@pytest.mark.parametrize("stream", [False, True])
def test_a_prefill_that_opens_think_makes_the_answer_reasoning_under_qwen3(client, model,
                                                                          stream):
    """An assistant prefill ``<think>`` continued (``continue_final_message``): the answer
    starts inside the reasoning, as the engine reads it for a grammar or a thinking budget,
    so it is split at ``</think>`` though it does not open with ``<think>``."""
    r = client.chat.completions.create(
        model=model, messages=[*HI, {"role": "assistant", "content": "<think>"}],
        temperature=0, max_tokens=20, stream=stream,
        extra_body={"continue_final_message": True, "add_generation_prompt": False})
    if stream:
        deltas = [c.choices[0].delta for c in r if c.choices]
        reasoning = "".join(getattr(d, "reasoning_content", None) or "" for d in deltas)
        content = "".join(d.content or "" for d in deltas)
    else:
        reasoning, content = r.choices[0].message.reasoning_content, r.choices[0].message.content
    assert (reasoning, content) == (REASONING, ANSWER)


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_thinking_block_carries_the_reasoning(tool_chat_server, model, stream):
    claude = anthropic.Anthropic(base_url=tool_chat_server.base_url, api_key="none",
                                 max_retries=0, timeout=120)
    args = {"model": model, "max_tokens": 40, "messages": HI,
            "extra_body": {"temperature": 0},
            "thinking": {"type": "enabled", "budget_tokens": 1024}}
    if stream:
        with claude.messages.stream(**args) as s:
            msg = s.get_final_message()
    else:
        msg = claude.messages.create(**args)
    assert [b.type for b in msg.content] == ["thinking", "text"]
    assert msg.content[0].thinking == REASONING and msg.content[0].signature == ""
    assert msg.content[1].text == ANSWER


def test_anthropic_without_thinking_enabled_has_no_thinking_block(tool_chat_server, model):
    r = httpx.post(f"{tool_chat_server.base_url}/v1/messages", timeout=120, json={
        "model": model, "max_tokens": 20, "messages": HI, "temperature": 0,
        "thinking": {"type": "disabled"}})
    assert r.status_code == 200, r.text
    # thinking off reaches the template: the model answers without thinking (with the call
    # it writes then, as text: the request has no tools)
    (block,) = r.json()["content"]
    assert block["type"] == "text" and block["text"].startswith("<tool_call>")


def test_latent_reasoning_on_a_model_without_latent_steps_is_a_400(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=HI, max_tokens=2,
                                       extra_body={"latent_reasoning": "logit_lens"})
    assert info.value.body["param"] == "latent_reasoning"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=HI, max_tokens=2,
                                       extra_body={"latent_reasoning": "words"})
    assert info.value.body["param"] == "latent_reasoning"


@pytest.mark.parametrize("body", [{"latent_reasoning": "count"},
                                  {"chat_template_kwargs": {"latent_reasoning": "count"}}])
def test_latent_reasoning_count_on_a_plain_model_is_a_400(smollm2_tokenizer, body):
    """A model without latent steps has no count to show: ``"count"`` would silently do
    nothing (as ``stream_latent_steps`` would), so only null is served there."""
    with stand_in_app(smollm2_tokenizer) as app:
        r = app.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "latent_reasoning" and "silently do nothing" in error["message"]
        ok = app.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2,
                                                    "latent_reasoning": None})
        assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("field", ["reasoning", "reasoning_content"])
def test_history_reasoning_under_either_name_reaches_the_template(tool_chat_server, model,
                                                                   field):
    """A client that round-trips an assistant message sends its reasoning back as
    ``reasoning`` (newer vLLM) or ``reasoning_content``; the prompt (the scripted template
    renders ``reasoning_content``) is the same either way and longer than without it; both,
    unequal, is a 400 naming the message."""
    url = f"{tool_chat_server.base_url}/v1/chat/completions"

    def prompt_tokens(turn: dict) -> int:
        r = httpx.post(url, timeout=120, json={
            "model": model, "max_tokens": 1, "messages": [
                *HI, {"role": "assistant", "content": "Hello!", **turn},
                {"role": "user", "content": "Again."}]})
        assert r.status_code == 200, r.text
        return r.json()["usage"]["prompt_tokens"]

    with_reasoning = prompt_tokens({field: "I should greet back."})
    assert with_reasoning == prompt_tokens({"reasoning": "I should greet back.",
                                            "reasoning_content": "I should greet back."})
    assert with_reasoning > prompt_tokens({})  # the template renders it
    r = httpx.post(url, timeout=120, json={"model": model, "messages": [
        *HI, {"role": "assistant", "content": "Hello!", "reasoning": "a",
              "reasoning_content": "b"}, {"role": "user", "content": "Again."}]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[1].reasoning"
