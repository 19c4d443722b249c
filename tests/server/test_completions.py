"""/v1/completions through the openai SDK, and stop strings."""

import pytest


def _greedy(client, model, prompt, max_tokens, extra_body=None, **kw):
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens,
                                     temperature=0,
                                     extra_body={"ignore_eos": True, **(extra_body or {})},
                                     **kw)


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


def test_echo_prepends_the_prompt(client, model):
    plain = _greedy(client, model, "Once upon a time", 4).choices[0].text
    echoed = _greedy(client, model, "Once upon a time", 4, echo=True).choices[0].text
    assert echoed == "Once upon a time" + plain


def test_echo_streams_the_prompt_first(client, model):
    plain = _greedy(client, model, "Once upon a time", 4).choices[0].text
    chunks = list(_greedy(client, model, "Once upon a time", 4, echo=True, stream=True))
    assert chunks[0].choices[0].text == "Once upon a time"
    assert "".join(c.choices[0].text for c in chunks) == "Once upon a time" + plain


def test_list_of_prompts_gives_choices_in_prompt_order(client, model):
    a = _greedy(client, model, "Hello there", 3).choices[0].text
    b = _greedy(client, model, [5, 6, 7], 3).choices[0].text
    r = _greedy(client, model, ["Hello there", "Hello there"], 3)
    assert [c.text for c in r.choices] == [a, a] and [c.index for c in r.choices] == [0, 1]
    ids = _greedy(client, model, [[5, 6, 7], [5, 6, 7]], 3, n=2)
    assert [c.text for c in ids.choices] == [b] * 4 and ids.usage.completion_tokens == 12
    assert ids.usage.prompt_tokens == 6


def test_logprobs_give_one_entry_per_token_with_k_alternatives(client, model):
    r = _greedy(client, model, "The sky is", 5, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob == max(top.values())  # greedy: the sampled token is top
        assert len(top) == 2
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]


def test_logprobs_match_the_model(client, model, tiny_model_dir, hf_models):
    import torch

    prompt = [1, 2000, 3000, 4000]
    r = _greedy(client, model, prompt, 1, logprobs=3)
    got = sorted(r.choices[0].logprobs.top_logprobs[0].values(), reverse=True)
    with torch.no_grad():
        logits = hf_models(tiny_model_dir)(torch.tensor([prompt])).logits[0, -1]
    want = torch.log_softmax(logits.float(), -1).topk(3).values.tolist()
    assert got == pytest.approx(want, abs=1e-4)


def test_tokens_as_token_ids(client, model, smollm2_tokenizer):
    r = _greedy(client, model, "Hi", 3, logprobs=0,
                extra_body={"return_tokens_as_token_ids": True})
    ids = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
    assert smollm2_tokenizer.decode(ids) == r.choices[0].text


def test_stream_n2_has_one_finish_reason_per_choice_and_usage_last(client, model):
    chunks = list(_greedy(client, model, "Hello", 3, n=2, stream=True,
                          stream_options={"include_usage": True}))
    for i in (0, 1):
        assert [c.choices[0].finish_reason for c in chunks
                if c.choices and c.choices[0].index == i and c.choices[0].finish_reason] == [
            "length"]
    assert [c for c in chunks if c.usage is not None] == [chunks[-1]]
    assert chunks[-1].usage.completion_tokens == 6


def _prompt_reference(tiny_model_dir, hf_models, prompt):
    import torch

    with torch.no_grad():
        logits = hf_models(tiny_model_dir)(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1)


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_reports_the_prompt_tokens_too(client, model, tiny_model_dir,
                                                          hf_models, stream):
    prompt = [1, 2000, 3000, 4000, 17]
    ref = _prompt_reference(tiny_model_dir, hf_models, prompt)
    r = _greedy(client, model, prompt, 3, logprobs=2, echo=True, stream=stream,
                extra_body={"return_tokens_as_token_ids": True})
    if stream:
        tokens, lps, tops, text = [], [], [], ""
        for c in r:
            for ch in c.choices:
                text += ch.text
                if ch.logprobs:
                    tokens += ch.logprobs.tokens
                    lps += ch.logprobs.token_logprobs
                    tops += ch.logprobs.top_logprobs
    else:
        ch = r.choices[0]
        text, tokens = ch.text, ch.logprobs.tokens
        lps, tops = ch.logprobs.token_logprobs, ch.logprobs.top_logprobs
    ids = [int(t.removeprefix("token_id:")) for t in tokens]
    assert ids[: len(prompt)] == prompt and len(ids) == len(prompt) + 3
    assert lps[0] is None and tops[0] is None  # nothing comes before the first token
    for p in range(1, len(prompt)):
        row = ref[p - 1]
        assert lps[p] == pytest.approx(float(row[prompt[p]]), abs=1e-4)
        top_v, top_i = row.topk(2)
        want_top = {f"token_id:{i}": v for i, v in zip(top_i.tolist(), top_v.tolist())}
        want_top.setdefault(f"token_id:{prompt[p]}", float(row[prompt[p]]))
        assert tops[p] == pytest.approx(want_top, abs=1e-4)
    assert all(v is not None for v in lps[len(prompt):])  # the generated tokens' logprobs
    from latentserve.models.checkpoint import load_tokenizer

    assert text.startswith(load_tokenizer(tiny_model_dir).decode(prompt))
