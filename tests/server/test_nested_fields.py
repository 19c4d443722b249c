"""Keys inside a body's objects (messages, content parts and blocks, tools, ``tool_choice``,
``thinking``, ``metadata``) are checked as top-level fields are: a key no protocol defines
is a 400 naming its path, one the protocol defines that is not implemented is served only
at its "not used" values, and every key the openai / anthropic SDKs can send is declared."""

import typing

import pytest

from latentserve.server.anthropic_api import AnthropicMessage
from latentserve.server.anthropic_blocks import (
    AnthropicMetadata,
    AnthropicThinking,
    AnthropicTool,
    AnthropicToolChoice,
    ContentBlock,
)
from latentserve.server.protocol import (
    ChatMessage,
    ChatTool,
    ContentPart,
    FunctionCall,
    FunctionDefinition,
    ToolCall,
)

USER = {"role": "user", "content": "hi"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
NAMED = {"type": "function", "function": {"name": "f"}}


def _history(call: dict) -> list[dict]:
    return [USER, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]


@pytest.mark.parametrize("extra,param", [
    ({"messages": [{**USER, "bogus": 1}]}, "messages[0].bogus"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "bogus": 1}]}]},
     "messages[0].content[0].bogus"),
    ({"messages": _history({**CALL, "bogus": 1})}, "messages[1].tool_calls[0].bogus"),
    ({"messages": _history({**CALL, "function": {**CALL["function"], "bogus": 1}})},
     "messages[1].tool_calls[0].function.bogus"),
    ({"tools": [{**TOOL, "bogus": 1}]}, "tools[0].bogus"),
    ({"tools": [{**TOOL, "function": {**TOOL["function"], "bogus": 1}}]},
     "tools[0].function.bogus"),
    ({"tools": [TOOL], "tool_choice": {**NAMED, "bogus": 1}}, "tool_choice.bogus"),
    ({"tools": [TOOL], "tool_choice": {**NAMED, "function": {"name": "f", "bogus": 1}}},
     "tool_choice.function.bogus"),
])
def test_chat_refuses_an_unknown_nested_key_by_its_path(http, model, extra, param):
    r = http.post("/v1/chat/completions",
                  json={"model": model, "max_tokens": 1, "messages": [USER], **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"] == {
        "message": f"Unrecognized request argument supplied: {param}",
        "type": "invalid_request_error", "param": param, "code": "unknown_field"}


def test_tokenize_refuses_an_unknown_key_of_a_message(http, model):
    r = http.post("/tokenize", json={"model": model, "messages": [{**USER, "bogus": 1}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].bogus"


@pytest.mark.parametrize("key,value", [("refusal", "no"), ("audio", {"id": "a1"}),
                                       ("function_call", {"name": "f", "arguments": "{}"})])
def test_an_unimplemented_message_key_is_refused_unless_null(http, model, key, value):
    body = {"model": model, "max_tokens": 1,
            "messages": [USER, {"role": "assistant", "content": "x", key: value}, USER]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == f"messages[1].{key}", r.text
    body["messages"][1][key] = None
    assert http.post("/v1/chat/completions", json=body).status_code == 200


def test_an_answer_sent_back_as_the_sdk_dumps_it_is_served(client, model):
    """``message.model_dump()`` of the openai SDK carries every response key (null
    ``refusal``, ``audio``, ``reasoning_content``, ...): the next turn takes it."""
    first = client.chat.completions.create(model=model, max_tokens=2, messages=[USER])
    turn = first.choices[0].message.model_dump()
    assert "reasoning_content" in turn and "refusal" in turn
    again = client.chat.completions.create(model=model, max_tokens=2,
                                           messages=[USER, turn, USER])
    assert again.choices[0].finish_reason is not None


def test_strict_tools_are_refused_where_calls_are_not_decoded_under_the_schema(http, model):
    """This server has no tool-call parser: under ``auto`` nothing would decode a strict
    tool's call (tests/server/test_tool_calls.py has the parser's structural tag)."""
    strict = {**TOOL, "function": {**TOOL["function"], "strict": True}}
    body = {"model": model, "max_tokens": 2, "messages": [USER], "tools": [strict]}
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].function.strict"
    r = http.post("/v1/chat/completions", json={**body, "tool_choice": NAMED})
    assert r.status_code == 200, r.text


ANTHROPIC_TOOL = {"name": "f", "input_schema": {"type": "object"}}


def _tool_turns(use: dict, result: dict) -> list[dict]:
    return [USER, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t1", "name": "f", "input": {}, **use}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", **result}]}]


@pytest.mark.parametrize("extra,param", [
    ({"messages": [{**USER, "bogus": 1}]}, "messages.0.bogus"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "bogus": 1}]}]},
     "messages.0.content.0.bogus"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "input": {}}]}]},
     "messages.0.content.0.input"),  # a key of another block type
    ({"messages": _tool_turns({"bogus": 1}, {"content": "ok"})}, "messages.1.content.0.bogus"),
    ({"messages": _tool_turns({}, {"content": [{"type": "text", "text": "ok", "bogus": 1}]})},
     "messages.2.content.0.content.0.bogus"),
    ({"system": [{"type": "text", "text": "sys", "bogus": 1}]}, "system.0.bogus"),
    ({"tools": [{**ANTHROPIC_TOOL, "bogus": 1}]}, "tools.0.bogus"),
    ({"tools": [ANTHROPIC_TOOL], "tool_choice": {"type": "auto", "name": "f"}},
     "tool_choice.name"),
    ({"thinking": {"type": "disabled", "bogus": 1}}, "thinking.bogus"),
    ({"metadata": {"user_id": "u", "bogus": 1}}, "metadata.bogus"),
])
def test_messages_refuses_an_unknown_nested_key_by_its_path(http, model, extra, param):
    r = http.post("/v1/messages",
                  json={"model": model, "max_tokens": 1, "messages": [USER], **extra})
    assert r.status_code == 400, r.text
    assert r.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": f"{param}: Extra inputs are not permitted"}}


def test_messages_serves_cache_hints_and_refuses_unimplemented_keys(http, model):
    cached = {"cache_control": {"type": "ephemeral"}}
    body = {"model": model, "max_tokens": 1, "tools": [{**ANTHROPIC_TOOL, **cached}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "hi", "citations": None, **cached}]}]}
    assert http.post("/v1/messages", json=body).status_code == 200
    body["messages"][0]["content"][0]["citations"] = [{"type": "char_location"}]
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("messages.0.content.0.citations: ")
    body = {"model": model, "max_tokens": 1, "messages": [USER],
            "tools": [{**ANTHROPIC_TOOL, "strict": True}]}
    r = http.post("/v1/messages", json=body)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith("tools.0.strict")


def test_messages_names_stop_sequences(http, model):
    r = http.post("/v1/messages", json={"model": model, "max_tokens": 1, "messages": [USER],
                                        "stop_sequences": [""]})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("stop_sequences: "), r.text


def _keys(params) -> set[str]:
    params = typing.get_origin(params) or params
    return set(params.__required_keys__) | set(params.__optional_keys__)


@pytest.mark.parametrize("params,model_class,kind", [
    ("openai.types.chat.ChatCompletionSystemMessageParam", ChatMessage, None),
    ("openai.types.chat.ChatCompletionUserMessageParam", ChatMessage, None),
    ("openai.types.chat.ChatCompletionAssistantMessageParam", ChatMessage, None),
    ("openai.types.chat.ChatCompletionToolMessageParam", ChatMessage, None),
    ("openai.types.chat.ChatCompletionContentPartTextParam", ContentPart, "text"),
    ("openai.types.chat.ChatCompletionMessageFunctionToolCallParam", ToolCall, None),
    ("openai.types.chat.chat_completion_message_function_tool_call_param.Function",
     FunctionCall, None),
    ("openai.types.chat.ChatCompletionFunctionToolParam", ChatTool, None),
    ("openai.types.shared_params.FunctionDefinition", FunctionDefinition, None),
    ("anthropic.types.TextBlockParam", ContentBlock, "text"),
    ("anthropic.types.ToolUseBlockParam", ContentBlock, "tool_use"),
    ("anthropic.types.ToolResultBlockParam", ContentBlock, "tool_result"),
    ("anthropic.types.ThinkingBlockParam", ContentBlock, "thinking"),
    ("anthropic.types.RedactedThinkingBlockParam", ContentBlock, "redacted_thinking"),
    ("anthropic.types.ToolParam", AnthropicTool, None),
    ("anthropic.types.ThinkingConfigEnabledParam", AnthropicThinking, None),
    ("anthropic.types.ThinkingConfigDisabledParam", AnthropicThinking, None),
    ("anthropic.types.ToolChoiceAutoParam", AnthropicToolChoice, "auto"),
    ("anthropic.types.ToolChoiceAnyParam", AnthropicToolChoice, "any"),
    ("anthropic.types.ToolChoiceToolParam", AnthropicToolChoice, "tool"),
    ("anthropic.types.ToolChoiceNoneParam", AnthropicToolChoice, "none"),
    ("anthropic.types.MetadataParam", AnthropicMetadata, None),
    ("anthropic.types.MessageParam", AnthropicMessage, None),
])
def test_every_sdk_nested_key_is_declared(params, model_class, kind):
    """Each key the SDKs' objects may carry is taken or served at its unused values, so a
    real client never gets ``unknown_field`` inside a body."""
    import importlib

    module, name = params.rsplit(".", 1)
    sdk = getattr(importlib.import_module(module), name)
    members = typing.get_args(sdk) if typing.get_origin(sdk) is typing.Union else (sdk,)
    keys = set().union(*(_keys(m) for m in members))
    types = model_class.TYPE_KEYS or {None: tuple(model_class.model_fields)}
    assert keys - set(types[kind]) - set(model_class.UNUSED) == set()


@pytest.mark.parametrize("route,body", [
    ("/v1/chat/completions", {"messages": [USER]}),
    ("/v1/completions", {"prompt": "hi"}),
])
def test_stream_options_without_streaming_is_refused(http, model, route, body):
    """``stream_options`` means nothing without ``stream: true``: a 400 (as vLLM), not
    ignored; with streaming it is served."""
    base = {"model": model, "max_tokens": 1, **body,
            "stream_options": {"include_usage": True}}
    r = http.post(route, json=base)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options", r.text
    r = http.post(route, json={**base, "stream": True})
    assert r.status_code == 200 and '"usage"' in r.text, r.text
