"""vLLM's ``return_token_ids`` and ``truncate_prompt_tokens`` on both OpenAI routes, through
the openai SDK (the extra fields read as attributes): the ids decode to the text, streamed
ids add up to the whole answer's, prompt ids are the (templated, cut) prompt's encoding, and
bad values are 400s naming the field."""

import json

import httpx
import openai
import pytest
from server_testlib import API_KEY, COLAR_STOP_STEPS, COLAR_STOPS, MAX_MODEL_LEN

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a color."}]
PROMPT = "Once upon a time there was"
IDS = {"return_token_ids": True, "ignore_eos": True}


def _complete(client, model, stream=False, max_tokens=8, **extra):
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=max_tokens,
                                     temperature=0, stream=stream, extra_body={**IDS, **extra})


def _chat(client, model, stream=False, max_tokens=8, **extra):
    return client.chat.completions.create(model=model, messages=MESSAGES,
                                          max_tokens=max_tokens, temperature=0, stream=stream,
                                          extra_body={**IDS, **extra})


def _templated(tok) -> list[int]:
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    return tok.encode(text, add_special_tokens=False)


def test_completion_ids_decode_to_the_text_and_prompt_ids_encode_the_prompt(
        client, model, smollm2_tokenizer):
    r = _complete(client, model)
    choice = r.choices[0]
    assert choice.prompt_token_ids == smollm2_tokenizer.encode(PROMPT)
    assert len(choice.token_ids) == r.usage.completion_tokens == 8
    assert smollm2_tokenizer.decode(choice.token_ids, skip_special_tokens=True) == choice.text


def test_completion_stream_ids_add_up_and_the_first_chunk_has_the_prompt(client, model):
    whole = _complete(client, model).choices[0]
    chunks = [c for c in _complete(client, model, stream=True) if c.choices]
    assert chunks[0].choices[0].prompt_token_ids == whole.prompt_token_ids
    assert all(getattr(c.choices[0], "prompt_token_ids", None) is None for c in chunks[1:])
    assert sum((c.choices[0].token_ids for c in chunks), []) == whole.token_ids


def test_completion_n2_gives_each_choice_its_own_ids(client, model, smollm2_tokenizer):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2, seed=3,
                                  temperature=1.0, extra_body=IDS)
    for choice in r.choices:
        assert choice.prompt_token_ids == smollm2_tokenizer.encode(PROMPT)
        assert smollm2_tokenizer.decode(choice.token_ids, skip_special_tokens=True) == \
            choice.text
    streamed: dict[int, list[int]] = {0: [], 1: []}
    for c in client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2, seed=3,
                                       temperature=1.0, stream=True, extra_body=IDS):
        for choice in c.choices:
            streamed[choice.index] += choice.token_ids
    assert [len(ids) for ids in streamed.values()] == [6, 6]


def test_without_the_field_no_ids_are_returned(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=2)
    assert "token_ids" not in (r.choices[0].model_extra or {})


def test_chat_ids_decode_to_the_content_and_prompt_ids_are_the_templated_prompt(
        client, model, smollm2_tokenizer):
    r = _chat(client, model)
    assert r.prompt_token_ids == _templated(smollm2_tokenizer)
    assert len(r.prompt_token_ids) == r.usage.prompt_tokens
    ids = r.choices[0].token_ids
    assert len(ids) == r.usage.completion_tokens == 8
    assert smollm2_tokenizer.decode(ids, skip_special_tokens=True) == r.choices[0].message.content


def test_chat_stream_role_chunk_has_the_prompt_and_ids_add_up(client, model):
    whole = _chat(client, model)
    chunks = list(_chat(client, model, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].prompt_token_ids == whole.prompt_token_ids
    assert sum((getattr(c.choices[0], "token_ids", None) or [] for c in chunks), []) == \
        whole.choices[0].token_ids


def test_completion_truncation_keeps_the_last_k_ids(client, model, smollm2_tokenizer):
    full = smollm2_tokenizer.encode(PROMPT)
    r = _complete(client, model, max_tokens=2, truncate_prompt_tokens=3)
    assert r.choices[0].prompt_token_ids == full[-3:]
    assert r.usage.prompt_tokens == 3
    ids = client.completions.create(model=model, prompt=[full], max_tokens=2,
                                    extra_body={"truncate_prompt_tokens": 2, **IDS})
    assert ids.choices[0].prompt_token_ids == full[-2:] and ids.usage.prompt_tokens == 2


def test_ids_are_checked_after_the_cut_as_vllm_does(client, model):
    """An out-of-vocabulary id that truncation drops is no error; one it keeps is a 400."""
    r = client.completions.create(model=model, prompt=[[10**6, 5, 6]], max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": 2})
    assert r.usage.prompt_tokens == 2
    with pytest.raises(openai.BadRequestError, match="prompt token ids must be in"):
        client.completions.create(model=model, prompt=[[5, 10**6]], max_tokens=2,
                                  extra_body={"truncate_prompt_tokens": 2})


def test_truncation_lets_a_prompt_over_the_context_run(client, model):
    r = client.completions.create(model=model, prompt=[[7] * (MAX_MODEL_LEN + 40)],
                                  max_tokens=2, extra_body={"truncate_prompt_tokens": 16})
    assert r.usage.prompt_tokens == 16


def test_chat_truncation_cuts_the_templated_prompt(client, model, smollm2_tokenizer):
    r = _chat(client, model, max_tokens=2, truncate_prompt_tokens=5)
    assert r.prompt_token_ids == _templated(smollm2_tokenizer)[-5:]
    assert r.usage.prompt_tokens == 5
    chunks = list(_chat(client, model, stream=True, max_tokens=2, truncate_prompt_tokens=5,
                        stream_options={"include_usage": True}))
    assert chunks[0].prompt_token_ids == r.prompt_token_ids
    assert chunks[-1].usage.prompt_tokens == 5


@pytest.mark.parametrize("value", [0, -2, MAX_MODEL_LEN + 1, "3", True, 1.5])
@pytest.mark.parametrize("route", ["chat", "completions"])
def test_bad_truncation_is_a_400_naming_the_field(client, model, route, value):
    send = _chat if route == "chat" else _complete
    with pytest.raises(openai.BadRequestError) as info:
        send(client, model, max_tokens=2, truncate_prompt_tokens=value)
    assert info.value.body["param"] == "truncate_prompt_tokens"
    assert info.value.body["type"] == "invalid_request_error"


def test_minus_one_truncates_to_the_context(client, model):
    """-1 keeps ``max_model_len`` tokens, which leaves none to generate: vLLM's 400."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt=[[7] * (MAX_MODEL_LEN + 5)],
                                  max_tokens=2, extra_body={"truncate_prompt_tokens": -1})
    assert info.value.body["code"] == "context_length_exceeded"
    assert f"prompt has {MAX_MODEL_LEN} tokens" in info.value.body["message"]


def test_a_bad_return_token_ids_is_a_400_naming_it(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        _chat(client, model, max_tokens=2, return_token_ids="yes")
    assert info.value.body["param"] == "return_token_ids"


@pytest.fixture
def tool_client(tool_chat_server):
    return openai.OpenAI(base_url=f"{tool_chat_server.base_url}/v1", api_key="none",
                         max_retries=0, timeout=120)


def test_ids_held_back_by_the_tool_parser_still_stream(tool_client, tool_chat_dir):
    """The hermes parser holds the call's text back; its ids come in empty-delta chunks."""
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}}}}]
    args = dict(model=str(tool_chat_dir), tools=tools, max_tokens=32, temperature=0,
                messages=[{"role": "user", "content": "Weather in Paris?"}],
                extra_body={"return_token_ids": True})
    whole = tool_client.chat.completions.create(**args)
    assert whole.choices[0].message.tool_calls and whole.choices[0].token_ids
    chunks = list(tool_client.chat.completions.create(stream=True, **args))
    assert sum((getattr(c.choices[0], "token_ids", None) or [] for c in chunks), []) == \
        whole.choices[0].token_ids


def test_a_latent_model_returns_the_answer_ids_and_no_latent_steps(colar_key_server):
    """CoLaR thinks in latent steps, which are no tokens: ``token_ids`` are the answer's ids
    (the text decodes from them), streamed with per-step ticks or not."""
    url, auth = f"{colar_key_server.base_url}/v1/completions", {"Authorization":
                                                                   f"Bearer {API_KEY}"}
    body = {"prompt": COLAR_STOPS, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    r = httpx.post(url, headers=auth, json=body, timeout=120).json()
    choice = r["choices"][0]
    assert choice["latent"]["steps"] == COLAR_STOP_STEPS
    assert len(choice["token_ids"]) == r["usage"]["completion_tokens"] == 4

    def decode(ids: list[int]) -> str:
        return httpx.post(f"{colar_key_server.base_url}/detokenize", headers=auth, timeout=30,
                          json={"tokens": ids}).json()["prompt"]

    prompt = choice["prompt_token_ids"]  # the text is decoded after the prompt
    assert decode(prompt + choice["token_ids"]) == decode(prompt) + choice["text"]
    streamed = []
    with httpx.stream("POST", url, headers=auth, timeout=120, json={
            **body, "stream": True, "stream_latent_steps": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                streamed += json.loads(line[6:])["choices"]
    assert streamed[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert sum((c["token_ids"] for c in streamed), []) == choice["token_ids"]
