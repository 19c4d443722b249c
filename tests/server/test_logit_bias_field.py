"""OpenAI's ``logit_bias`` on ``/v1/completions`` and ``/v1/chat/completions`` through the
real ``openai`` SDK (its own argument: string token ids -> bias), streamed and not, on the
tiny random model; bad keys and values are 400s naming the field."""

import openai
import pytest

MESSAGES = [{"role": "user", "content": "Tell me a story."}]


def _ids(client, model, stream, **kw):
    """Token ids of one completion (``return_tokens_as_token_ids``), streamed or not."""
    kw = dict(model=model, prompt="Once upon a time", max_tokens=8, logprobs=0,
              extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True}, **kw)
    if stream:
        tokens = [t for c in client.completions.create(stream=True, **kw)
                  for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    else:
        tokens = client.completions.create(**kw).choices[0].logprobs.tokens
    return [int(t.removeprefix("token_id:")) for t in tokens]


@pytest.mark.parametrize("stream", [False, True])
def test_completions_take_logit_bias(client, model, stream):
    free = _ids(client, model, stream, temperature=0)
    assert _ids(client, model, stream, temperature=0, logit_bias={"257": 100}) == [257] * 8
    assert _ids(client, model, stream, temperature=1.0, seed=2,
                logit_bias={"257": 100}) == [257] * 8
    banned = _ids(client, model, stream, temperature=0, logit_bias={str(free[0]): -100})
    assert banned[0] != free[0]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_takes_logit_bias(client, model, stream):
    kw = dict(model=model, messages=MESSAGES, max_tokens=6, temperature=0, logprobs=True,
              logit_bias={"257": 100},
              extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    if stream:
        content = [t for c in client.chat.completions.create(stream=True, **kw)
                   for ch in c.choices if ch.logprobs for t in ch.logprobs.content]
    else:
        content = client.chat.completions.create(**kw).choices[0].logprobs.content
    assert [t.token for t in content] == ["token_id:257"] * 6


@pytest.mark.parametrize("bias,msg", [
    ({"257": 101}, "[-100.0, 100.0]"), ({"257": -100.5}, "[-100.0, 100.0]"),
    ({"abc": 1}, "token ids"), ({"-3": 1}, "token ids"), ({"1.5": 1}, "token ids"),
    ({"49152": 1}, "[0, 49152)"), ({"257": "x"}, "logit_bias"), ({"257": True}, "logit_bias"),
])
@pytest.mark.parametrize("route", ["completions", "chat"])
def test_bad_logit_bias_is_a_400_naming_the_field(client, model, bias, msg, route):
    with pytest.raises(openai.BadRequestError) as info:
        if route == "chat":
            client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=2,
                                           logit_bias=bias)
        else:
            client.completions.create(model=model, prompt="Hi", max_tokens=2,
                                      logit_bias=bias)
    body = info.value.body
    assert body["param"] == "logit_bias" and msg in body["message"], body
