"""/v1/chat/completions through the openai SDK."""

import pytest

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a color."}]


def test_chat_returns_text_usage_and_length_finish(client, model):
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=6,
                                       temperature=0, extra_body={"ignore_eos": True})
    choice = r.choices[0]
    assert r.object == "chat.completion" and r.model == model
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens > 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + 6


def test_max_completion_tokens_overrides_max_tokens(client, model):
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=20,
                                       max_completion_tokens=3, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 3


def test_chat_stream_has_role_first_and_exactly_one_finish_reason(client, model):
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert reasons == ["length"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)


def test_chat_stream_text_equals_non_streamed_text(client, model):
    args = dict(model=model, messages=MESSAGES, max_tokens=10, temperature=0,
                extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**args).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or ""
                       for c in client.chat.completions.create(stream=True, **args))
    assert streamed == full


def test_include_usage_sends_exactly_one_usage_chunk_last(client, model):
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    with_usage = [c for c in chunks if c.usage is not None]
    assert len(with_usage) == 1 and with_usage[0] is chunks[-1]
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 5
    reasons = [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason]
    assert reasons == ["length"]


def test_models_lists_the_served_model(client, model):
    assert [m.id for m in client.models.list().data] == [model]


def test_message_reasoning_content_is_null_without_reasoning(http):
    r = http.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 2})
    message = r.json()["choices"][0]["message"]
    assert "reasoning_content" in message and message["reasoning_content"] is None


def test_n2_returns_two_indexed_choices_and_summed_usage(client, model):
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, n=2,
                                       temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 8
    single = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4,
                                            temperature=1.0, seed=7,
                                            extra_body={"ignore_eos": True})
    assert r.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once


def test_n2_with_seed_gives_choice_i_the_output_of_seed_plus_i(client, model):
    args = dict(model=model, messages=MESSAGES, max_tokens=6, temperature=1.0,
                extra_body={"ignore_eos": True})
    both = client.chat.completions.create(n=2, seed=100, **args)
    first = client.chat.completions.create(seed=100, **args).choices[0].message.content
    second = client.chat.completions.create(seed=101, **args).choices[0].message.content
    assert [c.message.content for c in both.choices] == [first, second]
    assert first != second


def test_n2_stream_gives_each_choice_one_role_chunk_and_one_finish_reason(client, model):
    chunks = list(client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=5, n=2, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert [c.delta.role for c in mine if c.delta.role] == ["assistant"]
        assert [c.finish_reason for c in mine if c.finish_reason] == ["length"]
    assert [c for c in chunks if c.usage is not None] == [chunks[-1]]
    assert chunks[-1].usage.completion_tokens == 10


def test_logprobs_report_top_k_sorted_with_greedy_token_first(client, model):
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=3,
                                       extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 == r.usage.completion_tokens
    assert b"".join(bytes(t.bytes) for t in content).decode() == r.choices[0].message.content
    for t in content:
        tops = [x.logprob for x in t.top_logprobs]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True) and tops[0] <= 0
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob


def test_streamed_logprobs_equal_non_streamed(client, model):
    args = dict(model=model, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
                top_logprobs=2, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**args).choices[0].logprobs.content
    streamed = [t for c in client.chat.completions.create(stream=True, **args)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in full]


def test_chat_template_kwargs_reach_the_template(client, model, smollm2_tokenizer):
    args = dict(model=model, messages=MESSAGES, max_tokens=1, temperature=0)
    with_prompt = client.chat.completions.create(**args).usage.prompt_tokens
    without = client.chat.completions.create(
        extra_body={"chat_template_kwargs": {"add_generation_prompt": False}}, **args)
    generation_prompt = len(smollm2_tokenizer.encode("<|im_start|>assistant\n"))
    assert without.usage.prompt_tokens == with_prompt - generation_prompt


def test_only_assistant_turn_is_a_400_not_a_500(client, model):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, max_tokens=2,
                                       messages=[{"role": "assistant", "content": "Hi!"}])
    assert info.value.status_code == 400 and info.value.body["param"] == "messages"


def test_developer_role_renders_as_system(client, model, smollm2_tokenizer):
    r = client.chat.completions.create(
        model=model, max_tokens=1, temperature=0,
        messages=[{"role": "developer", "content": "You are terse."}, MESSAGES[1]])
    # SmolLM2's template would render "developer" as is and add its default system prompt.
    assert r.usage.prompt_tokens == len(smollm2_tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True)["input_ids"])


@pytest.mark.parametrize("role", ["system", "developer"])
def test_conversation_without_a_user_turn_is_served(client, model, smollm2_tokenizer, role):
    r = client.chat.completions.create(
        model=model, max_tokens=2, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": role, "content": "Say a color."}])
    assert r.usage.completion_tokens == 2 and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(smollm2_tokenizer.apply_chat_template(
        [{"role": "system", "content": "Say a color."}], add_generation_prompt=True)["input_ids"])


# Compression-head controls sent to a model without a head (this tiny Llama): those that
# would do something get a 400 naming what was sent; thinking off is harmless.
_ROUTES = ["/v1/chat/completions", "/v1/completions", "/v1/messages"]
_OPENAI_ROUTES = _ROUTES[:2]  # the Messages API's thinking is Anthropic's object


@pytest.mark.parametrize("path,body,headers,param", [
    *[(p, {}, {"x-latent-max": "8"}, "x-latent-max") for p in _ROUTES],
    *[(p, {}, {"x-ds4-thinking": "1"}, "x-ds4-thinking") for p in _ROUTES],
    *[(p, {"max_latent": 8}, {}, "max_latent") for p in _ROUTES],
    *[(p, {"thinking": True}, {}, "thinking") for p in _OPENAI_ROUTES],
    ("/v1/messages", {"thinking": {"type": "enabled", "budget_tokens": 1024}}, {}, "thinking"),
])
def test_head_controls_without_a_head_are_400s_naming_them(http, model, path, body,
                                                           headers, param):
    r = http.post(path, json={**_route_body(path, model), **body}, headers=headers)
    assert r.status_code == 400, r.text
    assert param in r.text and "compression head" in r.text
    if path == "/v1/messages" and "thinking" in body:  # the way off in Anthropic's form
        message = r.json()["error"]["message"]
        assert 'send thinking: {"type": "disabled"}' in message
        assert "or <think> text under --reasoning-parser" in message  # the other ways on


@pytest.mark.parametrize("path,body,headers", [
    *[(p, {}, {"x-latent-thinking": "false"}) for p in _ROUTES],
    # thinking off: the other controls do nothing, so they are not refused either
    *[(p, {}, {"x-latent-thinking": "0", "x-latent-max": "8"}) for p in _ROUTES],
    *[(p, {"thinking": False, "max_latent": 8}, {}) for p in _OPENAI_ROUTES],
    ("/v1/messages", {"thinking": {"type": "disabled"}}, {}),  # what Anthropic clients send
    ("/v1/messages", {"thinking": {"type": "disabled"}}, {"x-latent-max": "3"}),
    ("/v1/messages", {"thinking": {"type": "disabled"}, "max_latent": 3}, {}),
])
def test_thinking_off_is_harmless_without_a_head(http, model, path, body, headers):
    r = http.post(path, json={**_route_body(path, model), **body}, headers=headers)
    assert r.status_code == 200, r.text


def test_enable_thinking_template_kwarg_is_harmless_without_a_head(client, model):
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                       extra_body={"chat_template_kwargs":
                                                   {"enable_thinking": True}})
    assert r.choices[0].finish_reason == "length"


def _route_body(path, model):
    msgs = [{"role": "user", "content": "hi"}]
    if path == "/v1/completions":
        return {"prompt": "hi", "max_tokens": 2}
    if path == "/v1/messages":
        return {"model": model, "messages": msgs, "max_tokens": 2}
    return {"messages": msgs, "max_tokens": 2}


@pytest.mark.parametrize("body,param", [
    ({"thinking": {"type": "sometimes"}}, "thinking.type"),
    ({"use_stop": 3}, "use_stop"),
    ({"max_latent": "x"}, "max_latent"),
])
def test_messages_head_fields_of_the_wrong_type_are_400s(http, model, body, param):
    r = http.post("/v1/messages", json={**_route_body("/v1/messages", model), **body})
    assert r.status_code == 400, r.text
    assert param in r.text
