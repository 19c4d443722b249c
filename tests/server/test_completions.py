"""/v1/completions through the openai SDK, and stop strings."""

import pytest


def _greedy(client, model, prompt, max_tokens, **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0, extra_body={"ignore_eos": True}, **kw)


def test_completion_returns_text_usage_and_length_finish(client, model, smollm2_tokenizer):
    r = _greedy(client, model, "Once upon a time", 7)
    assert r.object == "text_completion"
    assert r.choices[0].text
    assert r.choices[0].finish_reason == "length"
    num_prompt = len(smollm2_tokenizer.encode("Once upon a time"))
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (num_prompt, 7)


def test_token_id_prompt_is_accepted(client, model):
    r = _greedy(client, model, [1, 2000, 3000, 4000], 3)
    assert r.usage.prompt_tokens == 4 and r.usage.completion_tokens == 3


def test_completion_stream_has_exactly_one_finish_reason_and_same_text(client, model):
    full = _greedy(client, model, "The weather today", 12).choices[0].text
    chunks = list(_greedy(client, model, "The weather today", 12, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [
        "length"]


def test_completion_include_usage_sends_one_usage_chunk(client, model):
    chunks = list(_greedy(client, model, "Hello", 4, stream=True,
                          stream_options={"include_usage": True}))
    assert [c for c in chunks if c.usage is not None] == [chunks[-1]]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4


def _stop_string(text: str) -> str:
    """Two characters from the middle of ``text`` that are not just whitespace."""
    for k in range(len(text) // 2, len(text) - 1):
        if text[k:k + 2].strip():
            return text[k:k + 2]
    pytest.skip(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_generation_with_stop(client, model, stream):
    prompt = "A list of things:"
    full = _greedy(client, model, prompt, 30).choices[0].text
    stop = _stop_string(full)
    expected = full[: full.index(stop)]
    r = _greedy(client, model, prompt, 30, stop=[stop], stream=stream,
                stream_options={"include_usage": True} if stream else None)
    if stream:
        chunks = list(r)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        reasons = [c.choices[0].finish_reason for c in chunks
                   if c.choices and c.choices[0].finish_reason]
        usage = chunks[-1].usage
    else:
        text, reasons, usage = r.choices[0].text, [r.choices[0].finish_reason], r.usage
    assert text == expected
    assert reasons == ["stop"]
    assert usage.completion_tokens < 30


def test_chat_stop_string_ends_generation_with_stop(client, model):
    messages = [{"role": "user", "content": "Tell me a story."}]
    args = dict(model=model, messages=messages, max_tokens=30, temperature=0,
                extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**args).choices[0].message.content
    stop = _stop_string(full)
    r = client.chat.completions.create(stop=stop, **args)
    assert r.choices[0].message.content == full[: full.index(stop)]
    assert r.choices[0].finish_reason == "stop"
