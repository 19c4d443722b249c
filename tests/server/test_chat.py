"""/v1/chat/completions through the openai SDK."""

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
