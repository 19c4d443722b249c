"""vLLM's ``min_tokens``, ``include_stop_str_in_output``, ``bad_words`` and
``allowed_token_ids`` through the real ``openai`` SDK (``extra_body``, as a vLLM client sends
them), streamed and not: on the scripted model (exact text) and the tiny random one."""

import openai
import pytest
from server_testlib import EOS, SCRIPT_IDS, SCRIPT_START, SCRIPT_TEXT

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


@pytest.fixture
def scripted(scripted_server):
    return openai.OpenAI(base_url=f"{scripted_server.base_url}/v1", api_key="unused",
                         max_retries=0, timeout=120)


def _completion(client, model, stream, **kw):
    """(text, finish_reason, completion_tokens) of one completion, streamed or not."""
    if not stream:
        r = client.completions.create(model=model, **kw)
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens
    text, reason, usage = "", None, None
    for c in client.completions.create(model=model, stream=True,
                                       stream_options={"include_usage": True}, **kw):
        usage = c.usage or usage
        for ch in c.choices:
            text += ch.text
            reason = ch.finish_reason or reason
    return text, reason, usage.completion_tokens


def _chat(client, model, stream, **kw):
    if not stream:
        r = client.chat.completions.create(model=model, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, reason = "", None
    for c in client.chat.completions.create(model=model, stream=True, **kw):
        for ch in c.choices:
            text += ch.delta.content or ""
            reason = ch.finish_reason or reason
    return text, reason


def _model(client):
    return client.models.list().data[0].id


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_writes_past_the_scripts_eos(scripted, stream):
    model = _model(scripted)
    args = dict(prompt=[SCRIPT_START], max_tokens=len(SCRIPT_IDS) + 4, temperature=0)
    text, reason, n = _completion(scripted, model, stream, **args)
    assert (text, reason, n) == (SCRIPT_TEXT, "stop", len(SCRIPT_IDS) + 1)
    text, reason, n = _completion(scripted, model, stream, extra_body={"min_tokens": 16},
                                  **args)
    assert text.startswith(SCRIPT_TEXT) and reason == "length" and n == len(SCRIPT_IDS) + 4


@pytest.mark.parametrize("stream", [False, True])
def test_min_tokens_keeps_a_stop_string_from_ending_the_request_early(scripted, stream):
    model = _model(scripted)
    args = dict(prompt=[SCRIPT_START], max_tokens=30, temperature=0, stop=["llo"])
    assert _completion(scripted, model, stream, **args)[:2] == ("hé", "stop")
    # "llo" is token 3: with min_tokens 3 its text is not searched, and no later text has it
    text, reason, _ = _completion(scripted, model, stream, extra_body={"min_tokens": 3}, **args)
    assert (text, reason) == (SCRIPT_TEXT, "stop")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output_for_a_stop_string(scripted, stream, include):
    text, reason, _ = _completion(scripted, _model(scripted), stream, prompt=[SCRIPT_START],
                                  max_tokens=30, temperature=0, stop=["😀"],
                                  extra_body={"include_stop_str_in_output": include})
    assert reason == "stop"
    assert text == ("héllo 😀" if include else "héllo ")


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output_for_a_stop_token(scripted, stream, include):
    text, reason, _ = _completion(scripted, _model(scripted), stream, prompt=[SCRIPT_START],
                                  max_tokens=30, temperature=0,
                                  extra_body={"stop_token_ids": [SCRIPT_IDS[-1]],
                                              "include_stop_str_in_output": include})
    assert reason == "stop"
    assert text == (SCRIPT_TEXT if include else SCRIPT_TEXT[:-1])  # the "!" token


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("include", [False, True])
def test_include_stop_str_in_output_in_chat(client, model, stream, include):
    base = dict(messages=MESSAGES, max_tokens=16, temperature=0,
                extra_body={"ignore_eos": True})
    plain, _ = _chat(client, model, False, **base)
    stop = plain[5:8]
    assert stop.strip() and plain.find(stop) == 5
    text, reason = _chat(client, model, stream, messages=MESSAGES, max_tokens=16,
                         temperature=0, stop=[stop],
                         extra_body={"ignore_eos": True, "include_stop_str_in_output": include})
    assert reason == "stop"
    assert text == (plain[:8] if include else plain[:5])


@pytest.mark.parametrize("stream", [False, True])
def test_bad_words_are_never_produced(scripted, stream):
    model = _model(scripted)
    text, _, _ = _completion(scripted, model, stream, prompt=[SCRIPT_START], max_tokens=12,
                             temperature=0, extra_body={"bad_words": ["llo"]})
    assert text.startswith("hé") and "llo" not in text


def test_allowed_token_ids_only_yields_those_ids(client, model):
    allowed = [11, 257, 1000, 4000]
    for stream in (False, True):
        kw = dict(model=model, prompt="Once upon a time", max_tokens=10, temperature=1.0,
                  seed=3, logprobs=0,
                  extra_body={"allowed_token_ids": allowed, "return_tokens_as_token_ids": True,
                              "ignore_eos": True})
        if stream:
            tokens = [t for c in client.completions.create(stream=True, **kw)
                      for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
        else:
            tokens = client.completions.create(**kw).choices[0].logprobs.tokens
        ids = [int(t.removeprefix("token_id:")) for t in tokens]
        assert len(ids) == 10 and set(ids) <= set(allowed)


@pytest.mark.parametrize("body,field", [
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 9}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [10**6]}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"), ({"bad_words": "word"}, "bad_words"),
    ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
])
def test_bad_values_are_a_400_naming_the_field(client, model, body, field):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8,
                                       extra_body=body)
    assert info.value.body["param"] == field, info.value.body


@pytest.mark.parametrize("stream", [False, True])
def test_stop_token_ids_outside_the_vocabulary_are_a_400_with_the_range(client, model, stream):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="Hi", max_tokens=4, stream=stream,
                                  extra_body={"stop_token_ids": [13, 49152]})
    assert info.value.body["param"] == "stop_token_ids"
    assert info.value.body["message"] == "stop_token_ids must be in [0, 49152), got 49152"


def test_the_eos_id_of_the_scripted_model_is_the_servers(scripted):
    """(The scripted tests above rely on EOS being the tokenizer's, id 2.)"""
    r = scripted.completions.create(model=_model(scripted), prompt=[SCRIPT_START],
                                    max_tokens=30, temperature=0, logprobs=0,
                                    extra_body={"return_tokens_as_token_ids": True})
    assert r.choices[0].logprobs.tokens[-1] == f"token_id:{EOS}"
