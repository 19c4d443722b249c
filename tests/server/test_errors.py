"""Bad input gets a 400 with the OpenAI error body naming the problem, and the server keeps
serving: after each bad request, a valid one succeeds."""

import json

import pytest
from server_testlib import MAX_MODEL_LEN

LONG_IDS = [1000] * 300


def _chat(**fields):
    return ("/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields})


def _cmpl(**fields):
    return "/v1/completions", {"prompt": "hi", "max_tokens": 2, **fields}


# (case id, path, body (dict, or raw str sent as is), expected param, words in the message)
CASES = [
    ("empty-prompt", *_cmpl(prompt=""), "prompt", ["empty"]),
    ("empty-id-prompt", *_cmpl(prompt=[]), "prompt", ["empty"]),
    ("max-tokens-zero", *_cmpl(max_tokens=0), "max_tokens", ["max_tokens", "0"]),
    ("max-tokens-negative", *_chat(max_tokens=-5), "max_tokens", ["max_tokens", "-5"]),
    ("max-completion-tokens-zero", *_chat(max_completion_tokens=0), "max_completion_tokens",
     ["max_completion_tokens"]),
    ("prompt-too-long", *_cmpl(prompt=LONG_IDS), "prompt",
     ["maximum context length", "300", str(MAX_MODEL_LEN)]),
    ("chat-too-long", *_chat(messages=[{"role": "user", "content": "word " * 400}]),
     "messages", ["maximum context length", str(MAX_MODEL_LEN)]),
    ("prompt-plus-max-tokens-too-long", *_cmpl(prompt=[5] * 200, max_tokens=100),
     "max_tokens", ["maximum context length", "300 tokens", "200 in the prompt"]),
    ("malformed-json", "/v1/completions", '{"prompt": "hi", "max_tokens": ', None, ["JSON"]),
    ("body-not-object", "/v1/chat/completions", "[1, 2, 3]", None, ["JSON object"]),
    ("max-tokens-string", *_cmpl(max_tokens="ten"), "max_tokens", ["max_tokens"]),
    ("temperature-string", *_chat(temperature="hot"), "temperature", ["temperature"]),
    ("stream-not-bool", *_chat(stream="yes"), "stream", ["stream"]),
    ("prompt-wrong-type", *_cmpl(prompt=5), "prompt", ["prompt"]),
    ("role-wrong-type", *_chat(messages=[{"role": 7, "content": "x"}]), "messages[0].role",
     ["messages[0].role"]),
    ("include-usage-not-bool", *_chat(stream=True, stream_options={"include_usage": "y"}),
     "stream_options.include_usage", ["include_usage"]),
    ("stream-options-unimplemented-key", *_chat(stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True}),
     "stream_options.continuous_usage_stats",
     ["Unrecognized request argument supplied: stream_options.continuous_usage_stats"]),
    ("response-format-unknown-key", *_cmpl(response_format={"type": "json_object", "foo": 1}),
     "response_format.foo", ["foo"]),
    ("json-schema-unknown-key", *_chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {}, "foo": 1}}),
     "response_format.json_schema.foo", ["foo"]),
    ("service-tier-unknown", *_chat(service_tier="bogus"), "service_tier", ["service_tier"]),
    ("missing-messages", "/v1/chat/completions", {"max_tokens": 2}, "messages", ["messages"]),
    ("only-assistant-turn", *_chat(messages=[{"role": "assistant", "content": "Hello!"}]),
     "messages", ["user"]),
    ("unknown-role", *_chat(messages=[{"role": "wizard", "content": "x"}]), "messages[0].role",
     ["wizard"]),
    ("n-zero", *_chat(n=0), "n", ["n must be in [1, 16]"]),
    ("n-over-limit", *_cmpl(n=17), "n", ["n must be in [1, 16]"]),
    ("top-p-out-of-range", *_cmpl(top_p=1.5), "top_p", ["top_p"]),
    ("token-id-out-of-vocab", *_cmpl(prompt=[1, 10**6]), "prompt", ["1000000"]),
    ("empty-prompt-in-list", *_cmpl(prompt=["a", ""]), "prompt", ["empty"]),
    ("stream-empty-prompt", *_cmpl(prompt="", stream=True), "prompt", ["empty"]),
    ("top-logprobs-over-limit", *_chat(logprobs=True, top_logprobs=21), "top_logprobs",
     ["[0, 20]"]),
    ("top-logprobs-without-logprobs", *_chat(top_logprobs=2), "top_logprobs", ["logprobs"]),
    ("completion-logprobs-over-limit", *_cmpl(logprobs=21), "logprobs", ["[0, 20]"]),
    ("presence-penalty-out-of-range", *_cmpl(presence_penalty=2.5), "presence_penalty",
     ["presence_penalty", "2.5"]),
    ("repetition-penalty-zero", *_chat(repetition_penalty=0), "repetition_penalty",
     ["repetition_penalty"]),
    ("logit-bias-out-of-range", *_cmpl(logit_bias={"5": 101}), "logit_bias",
     ["[-100.0, 100.0]"]),
    ("reserved-template-kwarg", *_chat(chat_template_kwargs={"tokenize": False}),
     "chat_template_kwargs", ["tokenize"]),
    ("continue-without-assistant", *_chat(continue_final_message=True),
     "continue_final_message", ["assistant"]),
    ("continue-with-generation-prompt", *_chat(  # vLLM's 400, word for word
        messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "A"}],
        continue_final_message=True, add_generation_prompt=True),
     "continue_final_message", ["Cannot set both `continue_final_message` and "
                                "`add_generation_prompt` to True."]),
    ("user-content-null", *_chat(messages=[{"role": "user", "content": None}]),
     "messages[0].content", ["needs content"]),
    ("text-part-without-text", *_chat(messages=[{"role": "user",
                                                 "content": [{"type": "text"}]}]),
     "messages[0].content[0].text", ["string 'text'"]),
    ("lone-surrogate-prompt", "/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}',
     "prompt", ["surrogate"]),
    ("lone-surrogate-in-prompt-list", "/v1/completions",
     '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt", ["surrogate"]),
    ("lone-surrogate-chat", "/v1/chat/completions",
     '{"messages": [{"role": "user", "content": "a\\udc00"}]}', "messages[0].content",
     ["surrogate"]),
    ("lone-surrogate-model", "/v1/completions",
     '{"model": "\\udfff", "prompt": "hi", "max_tokens": 2}', "model", ["surrogate"]),
    ("lone-surrogate-tokenize", "/tokenize", '{"prompt": "a\\udc00"}', "prompt", ["surrogate"]),
    # template fields beside a plain prompt would do nothing; a bad tool as on the chat route
    ("tokenize-prompt-with-template-kwargs", "/tokenize",
     {"prompt": "hi", "chat_template_kwargs": {"thinking": True}}, "chat_template_kwargs",
     ["messages only"]),
    ("tokenize-prompt-with-generation-prompt", "/tokenize",
     {"prompt": "hi", "add_generation_prompt": False}, "add_generation_prompt",
     ["messages only"]),
    ("tokenize-bad-tool-name", "/tokenize",
     {"messages": [{"role": "user", "content": "hi"}], "tools": [
         {"type": "function", "function": {"name": "bad name", "parameters": {}}}]},
     "tools[0].function.name", ["bad name"]),
]


@pytest.mark.parametrize("path,body,param,words", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_request_gets_400_naming_the_problem_then_server_still_serves(
        http, model, path, body, param, words):
    raw = body if isinstance(body, str) else json.dumps(body)
    r = http.post(path, content=raw, headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    for word in words:
        assert word in error["message"], error["message"]
    assert "Traceback" not in r.text
    ok = http.post("/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/tokenize", {"prompt": "hi"}),
    ("/detokenize", {"tokens": [5]}),
])
def test_unknown_model_is_openais_404_model_not_found(http, path, body):
    r = http.post(path, json={"model": "gpt-9", **body})
    assert r.status_code == 404
    error = r.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert error["type"] == "invalid_request_error" and "gpt-9" in error["message"]


def test_openai_sdk_raises_not_found_for_an_unknown_model(client):
    import openai

    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert info.value.body["code"] == "model_not_found"


def test_prompt_too_long_is_openai_context_length_error(http):
    r = http.post("/v1/completions", json={"prompt": LONG_IDS, "max_tokens": 2})
    error = r.json()["error"]
    assert r.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["message"].startswith(
        f"This model's maximum context length is {MAX_MODEL_LEN} tokens. However, your "
        "prompt has 300 tokens")


def test_openai_sdk_raises_bad_request_error(client, model):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hi", max_tokens=0)
    assert info.value.body["param"] == "max_tokens"


def test_unknown_route_is_an_openai_error_404(http):
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_openai_sdk_retrieves_the_served_model_and_not_another(client, model):
    import openai

    card = client.models.retrieve(model)
    assert card.id == model
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-9")
    assert info.value.body["code"] == "model_not_found"
