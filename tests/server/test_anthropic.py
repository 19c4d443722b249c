"""/v1/messages through the anthropic SDK: messages, streaming events, stop sequences,
errors in Anthropic's shape, and the API key."""

import json

import anthropic
import pytest
from server_testlib import API_KEY, stand_in_app

MESSAGES = [{"role": "user", "content": "Name a color."}]
# This SDK version no longer has temperature/top_p/top_k arguments; they travel as extra body.
GREEDY = {"temperature": 0}


def test_message_has_text_stop_reason_and_usage(anthropic_client, model):
    m = anthropic_client.messages.create(model=model, max_tokens=5, messages=MESSAGES,
                                         extra_body=GREEDY)
    assert m.type == "message" and m.role == "assistant" and m.model == model
    assert [b.type for b in m.content] == ["text"] and m.content[0].text
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.output_tokens == 5 and m.usage.input_tokens > 5


def test_stream_sends_the_protocol_event_sequence(anthropic_client, model):
    events = list(anthropic_client.messages.create(
        model=model, max_tokens=6, messages=MESSAGES, stream=True, extra_body=GREEDY))
    kinds = [e.type for e in events]
    deltas = kinds.count("content_block_delta")
    assert kinds == (["message_start", "content_block_start"]
                     + ["content_block_delta"] * deltas
                     + ["content_block_stop", "message_delta", "message_stop"])
    assert deltas >= 1
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 6
    full = anthropic_client.messages.create(model=model, max_tokens=6, messages=MESSAGES,
                                            extra_body=GREEDY)
    assert "".join(e.delta.text for e in events if e.type == "content_block_delta") == \
        full.content[0].text
    assert events[0].message.usage.input_tokens == full.usage.input_tokens


def test_stream_helper_accumulates_the_message(anthropic_client, model):
    with anthropic_client.messages.stream(model=model, max_tokens=4, messages=MESSAGES,
                                          extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content[0].text == text and final.usage.output_tokens == 4


def test_stop_sequence_is_reported(anthropic_client, model):
    full = anthropic_client.messages.create(model=model, max_tokens=20, messages=MESSAGES,
                                            extra_body=GREEDY).content[0].text
    stop = next(full[k:k + 2] for k in range(len(full) // 2, len(full) - 1)
                if full[k:k + 2].strip())
    m = anthropic_client.messages.create(model=model, max_tokens=20, messages=MESSAGES,
                                         extra_body=GREEDY, stop_sequences=[stop])
    assert m.content[0].text == full[: full.index(stop)]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop


def test_system_prompt_is_templated_as_the_system_turn(anthropic_client, model,
                                                      smollm2_tokenizer):
    system = "You are a pirate who answers in rhymes."
    m = anthropic_client.messages.create(model=model, max_tokens=1, messages=MESSAGES,
                                         system=[{"type": "text", "text": system}])
    ids = smollm2_tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, *MESSAGES], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert m.usage.input_tokens == len(ids)


def test_bad_request_is_an_anthropic_error(anthropic_client, model):
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.create(model=model, max_tokens=0, messages=MESSAGES)
    assert info.value.body["type"] == "error"
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in info.value.body["error"]["message"]


def test_validation_error_is_an_anthropic_error(server, model):
    import httpx

    r = httpx.post(f"{server.base_url}/v1/messages", headers={"x-api-key": API_KEY},
                   json={"model": model, "messages": MESSAGES})  # no max_tokens
    assert r.status_code == 400
    assert r.json()["type"] == "error" and r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("extra, message", [
    ({"temperature": 2}, "temperature: must be in [0, 1], got 2.0"),
    ({"top_p": 2}, "top_p: must be in (0.0, 1.0], got 2.0"),
    ({"top_p": "x"}, "top_p: Input should be a valid number (got 'x')"),
    ({"thinking": {"type": "on"}}, "thinking.type: must be 'enabled' or 'disabled', got 'on'"),
    ({"thinking": {"type": "enabled", "budget_tokens": "x"}},
     "thinking.budget_tokens: Input should be a valid integer (got 'x')"),
    ({"thinking": {"type": "enabled", "budget_tokens": 1023}},
     "thinking.budget_tokens: Input should be greater than or equal to 1024 (got 1023)"),
    *[({"messages": [{"role": "user", "content": empty}]}, "messages.0.content: all messages "
       "must have non-empty content except for the optional final assistant message")
      for empty in ("", [])],
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
     "messages.0.content.0.text: text content blocks must be non-empty"),
    ({"system": [{"type": "text", "text": ""}]},
     "system.0.text: text content blocks must be non-empty"),
    ({"tool_choice": {"type": "auto", "disable_parallel_tool_use": "yes"}},
     "tool_choice.disable_parallel_tool_use: Input should be a valid boolean (got 'yes')"),
    ({"service_tier": "bogus"},
     "service_tier: Input should be 'auto' or 'standard_only' (got 'bogus')"),
])
def test_bad_fields_are_named_in_one_form(anthropic_client, model, extra, message):
    """Every field error reads ``field: reason`` (``top_p must ...`` and ``Invalid type for
    'top_p'`` came in other forms than ``temperature: must ...``)."""
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.create(model=model, max_tokens=2, messages=MESSAGES,
                                         extra_body=extra)
    assert info.value.body["error"]["message"] == message


def test_unknown_model_is_not_found(anthropic_client, model):
    """On /v1/messages and its count_tokens alike: Anthropic's 404 ``not_found_error``."""
    with pytest.raises(anthropic.NotFoundError) as created:
        anthropic_client.messages.create(model="claude-nope", max_tokens=2, messages=MESSAGES)
    with pytest.raises(anthropic.NotFoundError) as counted:
        anthropic_client.messages.count_tokens(model="claude-nope", messages=MESSAGES)
    for info in (created, counted):
        assert info.value.status_code == 404
        assert info.value.body == {"type": "error", "error": {
            "type": "not_found_error",
            "message": f"model: claude-nope (this server serves {model})"}}


def test_missing_api_key_is_an_authentication_error(server, model):
    no_key = anthropic.Anthropic(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as info:
        no_key.messages.create(model=model, max_tokens=2, messages=MESSAGES)
    assert info.value.body["error"]["type"] == "authentication_error"


def test_assistant_prefill_is_continued(anthropic_client, model):
    base = anthropic_client.messages.create(model=model, max_tokens=3, extra_body=GREEDY,
                                            messages=MESSAGES)
    prefilled = anthropic_client.messages.create(
        model=model, max_tokens=3, extra_body=GREEDY,
        messages=[*MESSAGES, {"role": "assistant", "content": "Blue"}])
    assert prefilled.usage.input_tokens > base.usage.input_tokens


@pytest.mark.parametrize("content", ["Blue ", "Blue\n", [{"type": "text", "text": "Blue\t"}]],
                         ids=["space", "newline", "block"])
def test_a_final_assistant_turn_may_not_end_in_whitespace(anthropic_client, model, content):
    """As Anthropic's API: a prefill ending in whitespace is a 400 naming the message; inside
    the conversation it is fine."""
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.create(
            model=model, max_tokens=2,
            messages=[*MESSAGES, {"role": "assistant", "content": content}])
    assert info.value.body["error"] == {
        "type": "invalid_request_error",
        "message": "messages.1.content: final assistant content cannot end with trailing "
                   "whitespace"}
    turns = [*MESSAGES, {"role": "assistant", "content": content},
             {"role": "user", "content": "Again."}]
    assert anthropic_client.messages.create(model=model, max_tokens=1, messages=turns).content


def test_a_user_turn_is_required_as_anthropics_protocol_says(anthropic_client, model):
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.create(model=model, max_tokens=2, system="Be terse.",
                                         messages=[{"role": "assistant", "content": "Hi"}])
    assert info.value.body["error"]["type"] == "invalid_request_error"
    assert "user" in info.value.body["error"]["message"]


def test_sampling_fields_travel_in_the_body(anthropic_client, model):
    args = dict(model=model, max_tokens=6, messages=MESSAGES)
    a = anthropic_client.messages.create(extra_body={"temperature": 1.0, "top_k": 1}, **args)
    b = anthropic_client.messages.create(extra_body=GREEDY, **args)
    assert a.content[0].text == b.content[0].text  # top_k=1 is greedy at any temperature


def test_count_tokens_equals_message_input_tokens(anthropic_client, model):
    counted = anthropic_client.messages.count_tokens(model=model, messages=MESSAGES)
    m = anthropic_client.messages.create(model=model, max_tokens=1, messages=MESSAGES)
    assert counted.input_tokens == m.usage.input_tokens


def test_text_blocks_are_joined_as_vllm_joins_them(anthropic_client, model,
                                                   smollm2_tokenizer):
    """A message's text blocks become one turn a line each, the system's run together (as
    vLLM's Anthropic route): the count equals the template on those strings."""
    blocks = [{"type": "text", "text": "Hi"}, {"type": "text", "text": "there"}]
    counted = anthropic_client.messages.count_tokens(
        model=model, system=[{"type": "text", "text": "Be "}, {"type": "text", "text": "brief"}],
        messages=[{"role": "user", "content": blocks}])
    ids = smollm2_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi\nthere"}],
        add_generation_prompt=True)
    assert counted.input_tokens == len(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_count_tokens_refuses_head_controls_a_plain_model_would_ignore(anthropic_client, model):
    """As ``/v1/messages`` does: a compression-head header on a model without a head."""
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.count_tokens(model=model, messages=MESSAGES,
                                               extra_headers={"x-latent-max": "2"})
    assert "x-latent-max" in info.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        anthropic_client.messages.create(model=model, max_tokens=2, messages=MESSAGES,
                                         extra_headers={"x-latent-max": "2"})


@pytest.mark.parametrize("extra", [
    {"return_latent_trace": True},  # refused by the engine: a plain model has no latents
    {"upstream_stop_rules": True},  # refused by the engine: no upstream rule to follow
    {"exit_semantics": "upstream"},  # refused by the engine: not a recurrent-depth model
    {"tools": [{"name": "f", "input_schema": {"type": "array"}}]},  # refused by the API:
    # a tool's input_schema must be an object schema
])
def test_count_tokens_refuses_what_messages_refuses(anthropic_client, model, extra):
    """A body ``/v1/messages`` answers with 400 gets the same 400 from count_tokens (the
    engine's own checks run dry there), and the engine is left with nothing queued."""
    with pytest.raises(anthropic.BadRequestError) as counted:
        anthropic_client.messages.count_tokens(model=model, messages=MESSAGES, extra_body=extra)
    with pytest.raises(anthropic.BadRequestError) as created:
        anthropic_client.messages.create(model=model, max_tokens=2, messages=MESSAGES,
                                         extra_body=extra)
    assert counted.value.body["error"]["message"] == created.value.body["error"]["message"]
    assert anthropic_client.messages.count_tokens(model=model, messages=MESSAGES).input_tokens


def test_count_tokens_of_a_prompt_that_leaves_no_room_names_no_max_tokens(anthropic_client,
                                                                          model):
    """count_tokens takes no max_tokens: a prompt that leaves no room for one answer token is
    a 400 (code context_length_exceeded) that does not mention a max_tokens nobody sent."""
    long = [{"role": "user", "content": "red green blue " * 200}]
    with pytest.raises(anthropic.BadRequestError) as info:
        anthropic_client.messages.count_tokens(model=model, messages=long)
    error = info.value.body["error"]
    assert "max_tokens" not in error["message"] and "prompt is too long" in error["message"]


def test_an_aborted_message_ends_in_an_error_event_not_a_stop_reason():
    """A stream cut by the server's drain ends in Anthropic's ``error`` event (no
    ``stop_reason`` says "aborted"; ``end_turn`` would pass for a finished answer); a
    finished one ends with ``message_delta`` and ``message_stop``."""
    import asyncio

    from latentserve.server.anthropic_api import _events
    from latentserve.server.generation import TextDelta
    from latentserve.server.output_parser import OutputParser

    async def run(reason):
        async def deltas():
            yield 0, TextDelta("Hel", None, 1)
            yield 0, TextDelta("lo", reason, 2)

        events = [e async for e in _events("msg_1", "m", 3, deltas(), False, OutputParser(),
                                           None, None)]
        return [json.loads(e.split("data: ", 1)[1]) for e in events]

    cut, done = asyncio.run(run("abort")), asyncio.run(run("stop"))
    assert cut[-1] == {"type": "error", "error": {"type": "api_error", "message": (
        "the request was aborted before it finished (the server is shutting down); "
        "retry it")}}
    assert not any(e["type"] in ("message_delta", "message_stop") for e in cut)
    assert [e["type"] for e in done[-2:]] == ["message_delta", "message_stop"]
    assert done[-2]["delta"]["stop_reason"] == "end_turn"


# --- refusals checked in the API process (an in-process app, a stand-in engine) -----------


@pytest.fixture(scope="module")
def app(smollm2_tokenizer):
    with stand_in_app(smollm2_tokenizer) as app:
        yield app


def _message(app, route="/v1/messages", **body):
    """``route``'s answer to a body of ``MESSAGES`` (``max_tokens`` 2 on /v1/messages)."""
    head = {"model": "m", "messages": MESSAGES}
    if route == "/v1/messages":
        head["max_tokens"] = 2
    return app.post(route, json={**head, **body})


def _error(r) -> str:
    assert r.status_code == 400, r.text
    assert r.json()["type"] == "error"
    return r.json()["error"]["message"]


USE = {"role": "assistant", "content": [
    {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}]}


def _result(tool_use_id: str) -> dict:
    return {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": tool_use_id, "content": "ok"}]}


def test_a_tool_result_needs_a_tool_use_with_its_id_in_the_previous_message(app):
    """As Anthropic's API: a ``tool_result`` answering no ``tool_use`` of the previous message
    is a 400 naming it."""
    message = _error(_message(app, messages=[*MESSAGES, USE, _result("toolu_2")]))
    assert message.startswith("messages.2.content.0.tool_use_id: unexpected `tool_use_id` "
                              "found in `tool_result` blocks: toolu_2.")
    assert "messages.0.content.0.tool_use_id" in _error(_message(
        app, messages=[_result("toolu_1")]))
    assert _message(app, messages=[*MESSAGES, USE, _result("toolu_1")]).status_code == 200
    later = [*MESSAGES, USE, _result("toolu_1"), {"role": "assistant", "content": "ok"},
             _result("toolu_1")]
    assert "messages.4.content.0.tool_use_id" in _error(_message(app, messages=later))


BOGUS = {"type": "bogus"}


@pytest.mark.parametrize("body,path", [
    ({"cache_control": BOGUS}, "cache_control.type"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi", "cache_control": BOGUS}]}]},
     "messages.0.content.0.cache_control.type"),
    ({"system": [{"type": "text", "text": "sys", "cache_control": BOGUS}]},
     "system.0.cache_control.type"),
    ({"tools": [{"name": "f", "input_schema": {"type": "object"}, "cache_control": BOGUS}]},
     "tools.0.cache_control.type"),
    ({"messages": [*MESSAGES, USE, {"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
            {"type": "text", "text": "ok", "cache_control": BOGUS}]}]}]},
     "messages.2.content.0.content.0.cache_control.type"),
    ({"cache_control": {"type": "ephemeral", "ttl": "2h"}}, "cache_control.ttl"),
    ({"cache_control": {"type": "ephemeral", "scope": "x"}}, "cache_control.scope"),
])
@pytest.mark.parametrize("route", ["/v1/messages", "/v1/messages/count_tokens"])
def test_cache_control_other_than_ephemeral_is_a_400_naming_its_path(app, route, body, path):
    assert _error(_message(app, route, **body)).startswith(f"{path}: ")


def test_ephemeral_cache_control_is_taken_everywhere(app):
    """The hint has no effect (the radix cache is automatic), with either ``ttl`` or none."""
    block = {"type": "text", "text": "sys", "cache_control": {"type": "ephemeral"}}
    r = _message(app, system=[block], cache_control={"type": "ephemeral", "ttl": "1h"},
                 tools=[{"name": "f", "input_schema": {"type": "object"},
                         "cache_control": {"type": "ephemeral", "ttl": "5m"}}])
    assert r.status_code == 200, r.text


def test_top_k_below_zero_is_a_400_and_zero_is_no_top_k(app):
    """Anthropic's API takes ``top_k`` >= 0; -1 (vLLM's "no top-k") is refused there."""
    assert _error(_message(app, top_k=-1)) == \
        "top_k: Input should be greater than or equal to 0 (got -1)"
    assert _message(app, top_k=0).status_code == 200


@pytest.mark.parametrize("field,value", [("stream", True), ("stream", False),
                                         ("max_tokens", 5), ("temperature", 0.5),
                                         ("top_k", 1), ("stop_sequences", ["x"]),
                                         ("metadata", {"user_id": "u"})])
def test_count_tokens_refuses_the_fields_it_does_not_take(app, field, value):
    """As Anthropic's count (``Extra inputs are not permitted``), whatever the value: they
    would change nothing in a count."""
    r = _message(app, "/v1/messages/count_tokens", **{field: value})
    assert _error(r) == f"{field}: Extra inputs are not permitted"
    assert _message(app, "/v1/messages/count_tokens").json()["input_tokens"] > 0
