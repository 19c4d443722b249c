"""vLLM's chat fields ``chat_template`` (a request's Jinja template, only with
``--trust-request-chat-template``) and ``echo`` (the last assistant message prepended to the
answer), through the openai SDK."""

import httpx
import openai
import pytest

# Renders each message's content followed by "|": the prompt is known exactly.
TEMPLATE = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
MESSAGES = [{"role": "user", "content": "Say hi"}]


@pytest.fixture(scope="module")
def trusting_server(tiny_model_dir):
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    srv = start_server(EngineConfig(model=str(tiny_model_dir), max_num_seqs=4), timeout=300,
                       trust_request_chat_template=True)
    yield srv
    srv.stop()


def test_request_chat_template_renders_the_prompt(trusting_server, tiny_model_dir,
                                                  smollm2_tokenizer):
    client = openai.OpenAI(base_url=f"{trusting_server.base_url}/v1", api_key="x",
                           max_retries=0)
    r = client.chat.completions.create(model=str(tiny_model_dir), messages=MESSAGES,
                                       max_tokens=1, extra_body={"chat_template": TEMPLATE})
    ids = smollm2_tokenizer.encode("Say hi|")
    assert r.usage.prompt_tokens == len(ids)
    tok = httpx.post(f"{trusting_server.base_url}/tokenize", timeout=60, json={
        "messages": MESSAGES, "chat_template": TEMPLATE}).json()
    assert tok["tokens"] == ids


def test_request_chat_template_that_does_not_parse_is_a_400(trusting_server, tiny_model_dir):
    client = openai.OpenAI(base_url=f"{trusting_server.base_url}/v1", api_key="x",
                           max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=str(tiny_model_dir), messages=MESSAGES,
                                       max_tokens=1, extra_body={"chat_template": "{% for"})
    assert info.value.body["param"] == "chat_template"
    assert "not a valid Jinja template" in info.value.body["message"]


def test_request_chat_template_that_renders_nothing_is_a_400_naming_it(trusting_server,
                                                                        tiny_model_dir):
    client = openai.OpenAI(base_url=f"{trusting_server.base_url}/v1", api_key="x",
                           max_retries=0)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model=str(tiny_model_dir), messages=MESSAGES, max_tokens=1,
            extra_body={"chat_template": "{% for m in messages %}{% endfor %}"})
    assert info.value.body["param"] == "chat_template"
    assert "empty prompt" in info.value.body["message"]


def test_request_chat_template_is_refused_unless_trusted(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1,
                                       extra_body={"chat_template": TEMPLATE})
    assert info.value.body["param"] == "chat_template"
    assert "--trust-request-chat-template" in info.value.body["message"]


PREFIX = "Once upon a time"
CONTINUED = [*MESSAGES, {"role": "assistant", "content": PREFIX}]


def _continue(client, model, echo, **kw):
    return client.chat.completions.create(
        model=model, messages=CONTINUED, max_tokens=4, temperature=0,
        extra_body={"echo": echo, "continue_final_message": True,
                    "add_generation_prompt": False, "ignore_eos": True}, **kw)


def test_echo_prepends_the_last_assistant_message(client, model):
    plain = _continue(client, model, False).choices[0].message.content
    echoed = _continue(client, model, True).choices[0].message.content
    assert PREFIX not in plain
    assert echoed == PREFIX + plain


def test_echo_streams_the_last_assistant_message_first(client, model):
    plain = _continue(client, model, False).choices[0].message.content
    chunks = [c.choices[0].delta.content for c in _continue(client, model, True, stream=True)
              if c.choices and c.choices[0].delta.content]
    assert chunks[0] == PREFIX and "".join(chunks) == PREFIX + plain


def test_echo_after_a_user_message_adds_nothing(client, model):
    args = {"model": model, "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    plain = client.chat.completions.create(**args).choices[0].message.content
    echoed = client.chat.completions.create(extra_body={"echo": True}, **args)
    assert echoed.choices[0].message.content == plain
