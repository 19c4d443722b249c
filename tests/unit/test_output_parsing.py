"""Reasoning and tool-call parsing of generated text (server/reasoning.py,
server/tool_parsers.py, server/output_parser.py): the whole text and the same text fed one
character at a time give the same reasoning, answer and calls."""

import json

import pytest

from latentserve.server.output_parser import OutputParser, join_calls, parse_output
from latentserve.server.tools import ToolChoice, call_schema, check_tools, resolve_tool_choice

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def _streamed(parser: OutputParser, text: str):
    pieces = [parser.step(c) for c in text] + [parser.step("", final=True)]
    return ("".join(p.reasoning for p in pieces), "".join(p.content for p in pieces),
            join_calls([c for p in pieces for c in p.calls]))


@pytest.mark.parametrize("parser,text,reasoning,content", [
    ("deepseek_r1", "<think>\nhmm\n</think>\n\nYes.", "\nhmm\n", "\n\nYes."),
    ("deepseek_r1", "hmm</think>Yes.", "hmm", "Yes."),  # R1: the prompt opened <think>
    ("deepseek_r1", "hmm, still thinking", "hmm, still thinking", ""),
    ("qwen3", "<think>hmm</think>Yes.", "hmm", "Yes."),
    ("qwen3", "Yes, no thinking.", "", "Yes, no thinking."),
    ("qwen3", "<think>cut short", "cut short", ""),
    ("qwen3", "a < b </think", "", "a < b </think"),
])
def test_think_text_splits_the_same_whole_or_streamed(parser, text, reasoning, content):
    whole = parse_output(OutputParser(reasoning_parser=parser), text)
    assert whole[:2] == (reasoning, content)
    got = _streamed(OutputParser(reasoning_parser=parser), text)
    assert got[:2] == (reasoning, content)


def test_hermes_calls_are_parsed_with_the_text_before_them_as_content():
    text = f"Let me look.\n{CALL}\n{CALL.replace('Paris', 'Rome')}"
    _, content, calls = parse_output(OutputParser(tool_parser="hermes",
                                                  choice=ToolChoice("auto")), text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]


def test_hermes_stream_equals_the_whole_and_ids_are_call_ids():
    choice = ToolChoice("auto")
    text = f"Sure. {CALL}"
    reasoning, content, calls = _streamed(OutputParser(tool_parser="hermes", choice=choice),
                                          text)
    assert (reasoning, content) == ("", "Sure.")
    assert len(calls) == 1 and calls[0].id.startswith("call_") and len(calls[0].id) == 29
    assert json.loads(calls[0].arguments) == {"city": "Paris"}


@pytest.mark.parametrize("text,content,calls", [
    ("no calls at all ", "no calls at all ", 0),
    ("<tool_call>not json</tool_call> tail", "<tool_call>not json</tool_call> tail", 0),
    ('<tool_call>{"name": "f", "arguments": {}}', "", 1),  # left open: still a call
    ('x <tool_call>{"name": "f", "argu', "x <tool_call>{\"name\": \"f\", \"argu", 0),
    ("a <tool_c", "a <tool_c", 0),
])
def test_hermes_edge_cases_whole_and_streamed_agree(text, content, calls):
    _, whole, whole_calls = parse_output(OutputParser(tool_parser="hermes",
                                                      choice=ToolChoice("auto")), text)
    assert (whole, len(whole_calls)) == (content, calls)
    _, got, got_calls = _streamed(OutputParser(tool_parser="hermes",
                                               choice=ToolChoice("auto")), text)
    assert (got, len(got_calls)) == (content, calls)


def test_single_keeps_the_first_call_only():
    parser = OutputParser(tool_parser="hermes", choice=ToolChoice("auto", single=True))
    _, _, calls = parse_output(parser, CALL + CALL.replace("Paris", "Rome"))
    assert len(calls) == 1 and json.loads(calls[0].arguments) == {"city": "Paris"}


def test_named_choice_streams_the_answer_as_the_arguments():
    parser = OutputParser(choice=ToolChoice("named", "get_weather", single=True))
    first = parser.step('{"city"')
    assert first.calls[0].name == "get_weather" and first.calls[0].id.startswith("call_")
    assert first.calls[1].arguments == '{"city"'
    rest = [parser.step(': "Paris"}'), parser.step("", final=True)]
    assert all(p.content == "" for p in [first, *rest])
    calls = join_calls(first.calls + [c for p in rest for c in p.calls])
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]


def test_required_answer_becomes_calls_and_bad_json_stays_text():
    text = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris"}},
                       {"name": "get_time", "parameters": {}}])
    _, content, calls = parse_output(OutputParser(choice=ToolChoice("required")), text)
    assert content == "" and [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": "Paris"}
    _, content, calls = parse_output(OutputParser(choice=ToolChoice("required")), '[{"na')
    assert content == '[{"na' and calls == []


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object",
                                          "properties": {"city": {"type": "string"}}}}},
    {"type": "function", "function": {"name": "get_time"}}]


def test_required_schema_is_an_array_of_named_calls():
    tools = check_tools(TOOLS)
    schema = call_schema(resolve_tool_choice("required", tools, parallel=False), tools)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    first, second = schema["items"]["anyOf"]
    assert first["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert first["properties"]["parameters"] == TOOLS[0]["function"]["parameters"]
    assert second["properties"]["parameters"] == {"type": "object", "properties": {}}
    named = resolve_tool_choice({"type": "function", "function": {"name": "get_weather"}},
                                tools)
    assert call_schema(named, tools) == TOOLS[0]["function"]["parameters"]


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "function", "function": {"name": "bad name"}}], None,
     "tools[0].function.name"),
    ([{"type": "function", "function": {"name": "get_weather\n"}}], None,  # '$' takes "\n"
     "tools[0].function.name"),
    (TOOLS + TOOLS[:1], None, "tools[2].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
     None, "tools[0].function.parameters"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    (TOOLS, "sometimes", "tool_choice"),
    ([], "required", "tool_choice"),
])
def test_bad_tools_and_choices_name_the_field(tools, choice, param):
    from latentserve.server.errors import APIError

    with pytest.raises(APIError) as info:
        resolve_tool_choice(choice, check_tools(tools))
    assert info.value.param == param


def test_a_forced_call_whose_schema_cannot_hold_names_the_tool_once():
    """A named tool's ``parameters`` with a keyword the grammar would not enforce: a 400
    naming that tool's field once, with the keyword's place in the call schema."""
    from types import SimpleNamespace

    from latentserve.sampling_params import SamplingParams
    from latentserve.server.errors import APIError
    from latentserve.server.output_parser import answer_params

    tools = check_tools([{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "array", "uniqueItems": True}}}}}])
    choice = resolve_tool_choice({"type": "function", "function": {"name": "f"}}, tools)
    with pytest.raises(APIError) as info:
        answer_params(SamplingParams(max_tokens=4), choice, tools, None,
                      SimpleNamespace(added_tokens_decoder={}), OutputParser(choice=choice))
    param = "tools[0].function.parameters"
    assert info.value.param == param
    assert str(info.value).startswith(f"{param}: uses a JSON-schema keyword")
    assert str(info.value).count(param) == 1 and "/x/uniqueItems" in str(info.value)


def test_special_tags_make_the_request_keep_special_tokens():
    from types import SimpleNamespace

    from latentserve.server.output_parser import drops_tags

    def tok(special: bool):
        return SimpleNamespace(added_tokens_decoder={
            7: SimpleNamespace(content="<tool_call>", special=special)})

    hermes = OutputParser(tool_parser="hermes", choice=ToolChoice("auto"))
    assert drops_tags(tok(True), hermes) and not drops_tags(tok(False), hermes)
    assert not drops_tags(tok(True), OutputParser(choice=ToolChoice("none")))


@pytest.mark.parametrize("split", [parse_output, _streamed])
def test_the_split_follows_where_the_prompt_left_the_reasoning(split):
    """An assistant prefill or a template ending in ``<think>`` (``opened``, as
    ``token_masks.reasoning_open`` finds it): the answer is reasoning up to ``</think>``, as
    the engine reads it when a grammar waits for the reasoning's end."""
    got = split(OutputParser(reasoning_parser="qwen3", opened=True), 'hmm</think>{"a": 0}')
    assert got[:2] == ("hmm", '{"a": 0}')
    assert split(OutputParser(reasoning_parser="qwen3", opened=True),
                 "<think>hmm</think>Yes.")[:2] == ("hmm", "Yes.")
    # deepseek_r1 after a prompt that closed the reasoning: the answer is content
    assert split(OutputParser(reasoning_parser="deepseek_r1", opened=False),
                 "yes")[:2] == ("", "yes")
