"""Tool calling through the openai and anthropic SDKs (issue 31), on the scripted chat model
of conftest.py served with ``--tool-call-parser hermes``: a call parsed out of the answer,
the round trip (call, result, final answer) streamed and not, and bad tool definitions as
400s naming the field."""

import json

import anthropic
import openai
import pytest

TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
ASK = [{"role": "user", "content": "Weather in Paris?"}]
ANSWER = "It is 18C in Paris."


@pytest.fixture
def client(tool_chat_server):
    return openai.OpenAI(base_url=f"{tool_chat_server.base_url}/v1", api_key="none",
                         max_retries=0, timeout=120)


@pytest.fixture
def claude(tool_chat_server):
    return anthropic.Anthropic(base_url=tool_chat_server.base_url, api_key="none",
                               max_retries=0, timeout=120)


@pytest.fixture
def model(tool_chat_dir):
    return str(tool_chat_dir)


def _chat(client, model, messages, stream: bool, **kw):
    """The whole completion; streamed, as the openai SDK accumulates the chunks."""
    if not stream:
        return client.chat.completions.create(model=model, messages=messages, tools=TOOLS,
                                              temperature=0, max_tokens=40, **kw)
    with client.chat.completions.stream(model=model, messages=messages, tools=TOOLS,
                                        temperature=0, max_tokens=40, **kw) as s:
        return s.get_final_completion()


def _choice(client, stream: bool, **kw):
    """The first choice of a completion; streamed, as the openai SDK accumulates it."""
    if not stream:
        return client.chat.completions.create(**kw).choices[0]
    with client.chat.completions.stream(**kw) as s:
        return s.get_final_completion().choices[0]


@pytest.mark.parametrize("stream", [False, True])
def test_openai_round_trip_call_result_answer(client, model, stream):
    first = _chat(client, model, ASK, stream).choices[0]
    assert first.finish_reason == "tool_calls"
    # null; streamed, "" (the role chunk's content, as OpenAI's first chunk has it)
    assert first.message.content == ("" if stream else None)
    (call,) = first.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": call.id, "type": "function",
            "function": {"name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "18C"}]
    final = _chat(client, model, history, stream).choices[0]
    assert final.finish_reason == "stop"
    assert final.message.content == ANSWER and not final.message.tool_calls


def test_streamed_call_is_one_tool_calls_delta_with_index_id_and_name(tool_chat_server,
                                                                       model):
    import httpx

    with httpx.stream("POST", f"{tool_chat_server.base_url}/v1/chat/completions",
                      timeout=120, json={"model": model, "messages": ASK, "tools": TOOLS,
                                         "temperature": 0, "stream": True}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: {")]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    calls = [d["tool_calls"] for d in deltas if "tool_calls" in d]
    assert len(calls) == 1 and len(calls[0]) == 1
    call = calls[0][0]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    assert not any(d.get("content") for d in deltas)  # the call's text is not content
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_tool_choice_none_leaves_the_call_as_text(client, model):
    r = _chat(client, model, ASK, False, tool_choice="none").choices[0]
    assert r.finish_reason == "stop" and not r.message.tool_calls
    assert r.message.content == ('<tool_call>\n{"name": "get_weather", '
                                 '"arguments": {"city": "Paris"}}\n</tool_call>')


ENUM_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("tool_choice", [
    "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_a_forced_call_is_decoded_under_the_tools_schema(client, model, tool_choice, stream):
    """The scripted model would answer with text; forced, its answer is a valid call (one:
    with parallel calls on, a model may list calls until max_tokens)."""
    r = _choice(client, stream, model=model, messages=[{"role": "user", "content": "Say hi"}],
                tools=ENUM_TOOLS, tool_choice=tool_choice, temperature=0, max_tokens=60,
                parallel_tool_calls=False)
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert r.finish_reason == ("tool_calls" if tool_choice == "required" else "stop")


def test_a_forced_call_with_a_response_format_is_refused(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, model, ASK, False, tool_choice="required",
              response_format={"type": "json_object"})
    assert info.value.body["param"] == "tool_choice"


@pytest.mark.parametrize("tools,tool_choice,param", [
    ([{"type": "function", "function": {"name": "get weather"}}], None,
     "tools[0].function.name"),
    (TOOLS + TOOLS, None, "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}],
     None, "tools[0].function.parameters"),
    ([{"type": "function", "function": {"description": "no name"}}], None,
     "tools[0].function.name"),
    (TOOLS, {"type": "function", "function": {"name": "get_time"}},
     "tool_choice.function.name"),
    (TOOLS, "sometimes", "tool_choice"),
    (None, "required", "tool_choice"),
    # a schema the grammar cannot follow, under a forced call: the tool's schema is named
    (TOOLS + [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "wizard"}}}}}],
     {"type": "function", "function": {"name": "f"}}, "tools[1].function.parameters"),
])
def test_bad_tools_are_a_400_naming_the_field(client, model, tools, tool_choice, param):
    kw = {} if tool_choice is None else {"tool_choice": tool_choice}
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=ASK, max_tokens=4,
                                       **({"tools": tools} if tools else {}), **kw)
    assert info.value.body["param"] == param


STRICT_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city", "strict": True,
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Rome", "Oslo"]}},
                   "required": ["city"], "additionalProperties": False}}}]


@pytest.mark.parametrize("stream", [False, True])
def test_a_strict_tool_under_auto_is_decoded_under_its_schema(client, model, stream):
    """``strict: true`` under ``tool_choice`` ``auto`` (the OpenAI Agents SDK's default): the
    answer is free text whose ``<tool_call>`` blocks follow the hermes parser's structural
    tag, so the scripted model's call (Paris) comes out in the schema (Rome or Oslo); with
    parallel calls off the tag ends the answer after the call."""
    r = _choice(client, stream, model=model, messages=ASK, tools=STRICT_TOOLS, temperature=0,
                max_tokens=60, parallel_tool_calls=False)
    (call,) = r.message.tool_calls
    assert call.function.name == "get_weather" and r.finish_reason == "tool_calls"
    assert json.loads(call.function.arguments)["city"] in ("Rome", "Oslo")


def test_a_strict_tool_under_auto_leaves_text_and_reasoning_as_they_are(client, model):
    """Text outside the call blocks is free: the thinking reply (reasoning, then "Hello!")
    is what it is with the same tool not strict."""
    kw = dict(model=model, messages=[{"role": "user", "content": "Hi"}], temperature=0,
              max_tokens=40, extra_body={"chat_template_kwargs": {"enable_thinking": True}})
    plain = client.chat.completions.create(tools=TOOLS, **kw).choices[0].message
    strict = client.chat.completions.create(tools=STRICT_TOOLS, **kw).choices[0].message
    assert strict.content == plain.content and "Hello!" in strict.content
    assert strict.reasoning_content == plain.reasoning_content and not strict.tool_calls


def test_a_strict_tool_with_a_response_format_is_refused(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=ASK, tools=STRICT_TOOLS,
                                       max_tokens=4, response_format={"type": "json_object"})
    assert info.value.body["param"] == "tools"


def test_a_strict_tool_nested_too_deep_is_a_400_naming_tools(client, model):
    """Deeper than Python's recursion limit allows: a 400 naming ``tools`` (once a 500, in
    the check for lone surrogates and then in pickling the request to the engine); the
    server answers the next request."""
    deep = json.loads('{"type": "array", "items": ' * 600 + "{}" + "}" * 600)
    tools = [{"type": "function", "function": {
        "name": "f", "strict": True,
        "parameters": {"type": "object", "properties": {"a": deep}}}}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=ASK, tools=tools, max_tokens=4)
    assert info.value.body["param"] == "tools"
    r = client.chat.completions.create(model=model, messages=ASK, tools=STRICT_TOOLS,
                                       temperature=0, max_tokens=60, parallel_tool_calls=False)
    assert r.choices[0].finish_reason == "tool_calls"


# --- Anthropic /v1/messages ----------------------------------------------------------------

CLAUDE_TOOLS = [{"name": "get_weather", "description": "Weather of a city",
                 "input_schema": TOOLS[0]["function"]["parameters"]}]


def _message(claude, model, messages, stream: bool, **kw):
    args = {"model": model, "max_tokens": 40, "messages": messages, "tools": CLAUDE_TOOLS,
            "extra_body": {"temperature": 0}, **kw}
    if not stream:
        return claude.messages.create(**args)
    with claude.messages.stream(**args) as s:
        return s.get_final_message()


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_round_trip_tool_use_result_answer(claude, model, stream):
    first = _message(claude, model, ASK, stream)
    assert first.stop_reason == "tool_use"
    (use,) = first.content
    assert use.type == "tool_use" and use.id.startswith("toolu_")
    assert use.name == "get_weather" and use.input == {"city": "Paris"}
    history = ASK + [
        {"role": "assistant", "content": [use.model_dump()]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": "18C"}]}]}]
    final = _message(claude, model, history, stream)
    assert final.stop_reason == "end_turn"
    assert [(b.type, b.text) for b in final.content] == [("text", ANSWER)]


def test_anthropic_stream_sends_tool_use_start_then_input_json(tool_chat_server, model):
    import httpx

    with httpx.stream("POST", f"{tool_chat_server.base_url}/v1/messages", timeout=120,
                      json={"model": model, "max_tokens": 40, "messages": ASK,
                            "tools": CLAUDE_TOOLS, "temperature": 0, "stream": True}) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds == ["message_start", "ping", "content_block_start", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]
    block = events[2]["content_block"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather"
    assert block["input"] == {}
    delta = events[3]["delta"]
    assert delta["type"] == "input_json_delta"
    assert json.loads(delta["partial_json"]) == {"city": "Paris"}
    assert events[5]["delta"]["stop_reason"] == "tool_use"


@pytest.mark.parametrize("tool_choice", [
    {"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}])
def test_anthropic_forced_tool_use_is_decoded_under_the_schema(claude, model, tool_choice):
    tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema":
              ENUM_TOOLS[0]["function"]["parameters"]}]
    r = claude.messages.create(model=model, max_tokens=60, tools=tools, tool_choice=tool_choice,
                               messages=[{"role": "user", "content": "Say hi"}])
    (block,) = [b for b in r.content if b.type == "tool_use"]
    assert block.name == "get_weather" and block.input["city"] in ("Paris", "Rome")


@pytest.mark.parametrize("stream", [False, True])
def test_anthropic_forced_tool_use_cut_by_max_tokens_is_a_tool_use_block(claude, model, stream):
    """Cut short, a forced call is still a ``tool_use`` block, streamed or not (the stream's
    ``input_json_delta`` carries the cut JSON; a whole message keeps its complete members),
    and ``stop_reason`` is ``max_tokens``, as Anthropic closes a truncated call."""
    tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema":
              ENUM_TOOLS[0]["function"]["parameters"]}]
    r = _message(claude, model, [{"role": "user", "content": "Say hi"}], stream, tools=tools,
                 tool_choice={"type": "tool", "name": "get_weather"}, max_tokens=3)
    assert r.stop_reason == "max_tokens"
    assert [(b.type, b.name, b.input) for b in r.content] == [("tool_use", "get_weather", {})]


def test_a_cut_tool_calls_input_keeps_its_complete_members():
    from latentserve.server.anthropic_api import complete_members

    for text, want in (('{"city": "Paris"}', {"city": "Paris"}), ('{"city": "Par', {}),
                       ('{"city": "Paris", "unit": "c', {"city": "Paris"}),
                       ('{"a": {"x": 1}, "b": [1, 2', {"a": {"x": 1}}),
                       ('{"a": 12', {}), ('{"a": true , "b": null', {"a": True}),
                       ("", {}), ("[1, 2]", {}), ('{"a"', {})):
        assert complete_members(text) == want, text


def test_anthropic_strict_tool_under_auto_is_decoded_under_its_schema(claude, model):
    tools = [{"name": "get_weather", "description": "Weather of a city", "strict": True,
              "input_schema": STRICT_TOOLS[0]["function"]["parameters"]}]
    r = claude.messages.create(model=model, max_tokens=60, tools=tools, messages=ASK,
                               tool_choice={"type": "auto", "disable_parallel_tool_use": True},
                               extra_body={"temperature": 0})
    (block,) = [b for b in r.content if b.type == "tool_use"]
    assert block.name == "get_weather" and block.input["city"] in ("Rome", "Oslo")
    assert r.stop_reason == "tool_use"


def test_anthropic_tool_choice_none_answers_in_text(claude, model):
    r = _message(claude, model, ASK, False, tool_choice={"type": "none"})
    assert r.stop_reason == "end_turn" and [b.type for b in r.content] == ["text"]
    assert r.content[0].text.startswith("<tool_call>")


@pytest.mark.parametrize("body,field", [
    ({"tools": [{"name": "get weather", "input_schema": {"type": "object"}}]},
     "tools.0.name"),
    ({"tools": [{"name": "get_weather"}]}, "tools.0.input_schema"),
    ({"tools": [{"name": "f", "input_schema": {"type": "string"}}]}, "tools.0.input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools.0.type"),
    ({"tools": CLAUDE_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "tool_choice.name"),
    ({"tools": CLAUDE_TOOLS, "tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"tools": CLAUDE_TOOLS + [{"name": "f", "input_schema": {
        "type": "object", "properties": {"a": {"type": "wizard"}}}}],
      "tool_choice": {"type": "tool", "name": "f"}}, "tools.1.input_schema"),
    ({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": ""}}]}]}, "messages.0.content.0"),
])
def test_anthropic_bad_tools_are_a_400_naming_the_field(tool_chat_server, model, body, field):
    import httpx

    r = httpx.post(f"{tool_chat_server.base_url}/v1/messages", timeout=120,
                   json={"model": model, "max_tokens": 4, "messages": ASK, **body})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["message"].startswith(field), err
