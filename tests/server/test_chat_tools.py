"""Tool use in a chat's history (issue 28): the request's ``tools``, an assistant turn's
``tool_calls`` and a tool message's ``tool_call_id`` and ``name`` reach the chat template,
through the openai SDK; a forced tool call (``tool_choice`` "required" or a named function)
is refused while the server has no constrained decoding (test_tool_calls.py has the calls
parsed out of the answer)."""

import json

import httpx
import openai
import pytest
from server_testlib import MAX_MODEL_LEN

# A Qwen2.5-like template that shows everything a tool-aware template reads (transformers
# renders with trim_blocks: a newline right after a block tag is dropped).
TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}("
    "{{ t.function.parameters.properties | join(',') }}){% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}"
    "{% if m.name %} name={{ m.name }}{% endif %}"
    "{% if m.tool_call_id %} id={{ m.tool_call_id }}{% endif %}{{ '\\n' + m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"id\": \"{{ c.id }}\", \"name\": "
    "\"{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}"
    "</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [{
        "id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})}}]},
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18C"},
]
RENDERED = (
    "<tools>get_weather(city)</tools>\n"
    "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
    "<|im_start|>assistant\n<tool_call>{\"id\": \"call_1\", \"name\": \"get_weather\", "
    "\"arguments\": {\"city\": \"Paris\"}}</tool_call><|im_end|>\n"
    "<|im_start|>tool name=get_weather id=call_1\n18C<|im_end|>\n"
    "<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def tools_dir(tmp_path_factory, smollm2_dir):
    from transformers import AutoTokenizer

    from latentserve.bench.baseline.tiny_models import save_tiny

    d = save_tiny(tmp_path_factory.mktemp("chat-tools") / "tiny-llama", "llama",
                  max_position_embeddings=MAX_MODEL_LEN)
    tok = AutoTokenizer.from_pretrained(d)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tools_server(tools_dir):
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    srv = start_server(EngineConfig(model=str(tools_dir), max_num_seqs=2), timeout=300)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def model(tools_dir):
    """The served model's name (the directory it was loaded from)."""
    return str(tools_dir)


@pytest.fixture(scope="module")
def tok(tools_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tools_dir)


@pytest.fixture
def client(tools_server):
    return openai.OpenAI(base_url=f"{tools_server.base_url}/v1", api_key="none",
                         max_retries=0, timeout=120)


@pytest.fixture
def http(tools_server):
    with httpx.Client(base_url=tools_server.base_url, timeout=120) as c:
        yield c


def test_tool_call_history_and_tools_reach_the_template(client, http, tok, model):
    expected = tok.encode(RENDERED, add_special_tokens=False)
    r = http.post("/tokenize", json={"messages": MESSAGES, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == expected
    chat = client.chat.completions.create(model=model,
                                          messages=MESSAGES, tools=TOOLS, max_tokens=1)
    assert chat.usage.prompt_tokens == len(expected)


@pytest.mark.parametrize("tool_choice", ["none", "auto"])
def test_tool_choice_that_forces_nothing_is_served(client, tok, model, tool_choice):
    r = client.chat.completions.create(model=model, messages=MESSAGES,
                                       tools=TOOLS, tool_choice=tool_choice, max_tokens=1)
    assert r.usage.prompt_tokens == len(tok.encode(RENDERED, add_special_tokens=False))


def test_tool_call_arguments_that_are_not_json_are_a_400_naming_them(client, model):
    bad = json.loads(json.dumps(MESSAGES))
    bad[1]["tool_calls"][0]["function"]["arguments"] = "{city: Paris"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=bad,
                                       max_tokens=1)
    assert info.value.body["param"] == "messages[1].tool_calls[0].function.arguments"


def test_a_tool_that_is_not_a_function_is_a_400_naming_its_type(http):
    r = http.post("/v1/chat/completions", json={
        "messages": MESSAGES, "max_tokens": 1,
        "tools": [{"type": "custom", "function": {"name": "x"}}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools[0].type"
