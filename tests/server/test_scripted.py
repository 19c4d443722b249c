"""Exact-text cases on the scripted model (see server_testlib): multi-byte characters split
over tokens, stop strings split over tokens, penalties and raw logprobs."""

import json
import math

import pytest
from server_testlib import (
    LOOP,
    SCRIPT_IDS,
    SCRIPT_LOGIT,
    SCRIPT_START,
    SCRIPT_TEXT,
    VOCAB,
    A,
    B,
    X,
    Y,
    scripted_logit,
)


def _stream(http, **body) -> tuple[list[str], list[str], dict | None]:
    """(text of each chunk, finish reasons, usage) of a streamed completion."""
    texts, reasons, usage = [], [], None
    with http.stream("POST", "/v1/completions", json={"stream": True, **body}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            for c in chunk["choices"]:
                texts.append(c["text"])
                if c["finish_reason"]:
                    reasons.append(c["finish_reason"])
    return texts, reasons, usage


def test_emoji_and_cjk_split_across_tokens_stream_without_replacement_char(scripted_http):
    texts, reasons, _ = _stream(scripted_http, prompt=[SCRIPT_START], max_tokens=30,
                                temperature=0)
    assert "".join(texts) == SCRIPT_TEXT
    assert not any("\ufffd" in t for t in texts)
    assert reasons == ["stop"]  # the script ends with EOS


def test_stop_string_split_over_several_tokens_leaks_nothing_in_a_stream(scripted_http):
    # "llo 😀" spans four tokens: "llo", " \xf0\x9f\x98", "\x80" (+ the space after it)
    texts, reasons, usage = _stream(scripted_http, prompt=[SCRIPT_START], max_tokens=30,
                                    temperature=0, stop=["llo 😀"],
                                    stream_options={"include_usage": True})
    assert "".join(texts) == "hé"
    assert reasons == ["stop"]
    assert usage["completion_tokens"] == 5  # h, é, llo, the emoji's two tokens


def test_text_that_might_start_a_stop_string_is_released_when_it_does_not(scripted_http):
    texts, reasons, _ = _stream(scripted_http, prompt=[SCRIPT_START], max_tokens=30,
                                temperature=0, stop=["llo 😀 世界?"])
    assert "".join(texts) == SCRIPT_TEXT
    assert reasons == ["stop"]


def _token_ids(http, max_tokens, **sampling) -> list[int]:
    r = http.post("/v1/completions", json={
        "prompt": [A], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "logprobs": 0, "return_tokens_as_token_ids": True, **sampling})
    assert r.status_code == 200, r.text
    return [int(t.removeprefix("token_id:")) for t in r.json()["choices"][0]["logprobs"]["tokens"]]


@pytest.mark.parametrize("sampling,expected", [
    ({}, [B, A, B, A, B]),
    # presence: -0.6 once per present token: 8 - 0.6 > 7, the loop goes on
    ({"presence_penalty": 0.6}, [B, A, B, A, B]),
    # frequency: -0.6 per occurrence: B's third time scores 8 - 1.2 < 7, X wins
    ({"frequency_penalty": 0.6}, [B, A, B, A, X]),
    # presence 1.5: B's second time scores 6.5 < 7
    ({"presence_penalty": 1.5}, [B, A, X]),
    # repetition 2 counts the prompt: A (in the prompt) scores 8 / 2 < 7 at once, Y wins
    ({"repetition_penalty": 2.0}, [B, Y]),
], ids=["none", "presence-small", "frequency", "presence-large", "repetition"])
def test_penalties_follow_vllm_semantics(scripted_http, sampling, expected):
    assert _token_ids(scripted_http, 5, **sampling)[:len(expected)] == expected


def _first_logprobs(http, **sampling) -> dict:
    r = http.post("/v1/completions", json={"prompt": [SCRIPT_START], "max_tokens": 1,
                                           "logprobs": 1, **sampling})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["logprobs"]


def test_logprobs_are_the_raw_model_distribution(scripted_http):
    logit = scripted_logit(SCRIPT_LOGIT)
    log_z = math.log(math.exp(logit) + VOCAB - 1)  # every other logit is 0
    greedy = _first_logprobs(scripted_http, temperature=0)
    assert greedy["token_logprobs"][0] == pytest.approx(logit - log_z, abs=1e-4)
    # temperature, top-k and penalties change the sampling, not the reported logprobs
    sampled = _first_logprobs(scripted_http, temperature=0.5, top_k=1, seed=1,
                              repetition_penalty=1.5)
    assert sampled["tokens"] == greedy["tokens"]
    assert sampled["token_logprobs"] == pytest.approx(greedy["token_logprobs"], abs=1e-6)


def test_logprobs_cover_every_counted_token_including_eos(scripted_http):
    r = scripted_http.post("/v1/completions", json={
        "prompt": [SCRIPT_START], "max_tokens": 30, "temperature": 0, "logprobs": 0})
    body = r.json()
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == body["usage"]["completion_tokens"] == len(SCRIPT_IDS) + 1
    assert lp["tokens"][-1] == "<|im_end|>"


def _logprob_ids(choice_logprobs) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice_logprobs["tokens"]]


@pytest.mark.parametrize("stop,text,kept", [
    ("世界", "héllo 😀 ", 6),  # the stop starts on a token boundary: its tokens are dropped
    ("lo 😀", "hél", 3),  # it starts inside "llo": that token is kept, later ones dropped
])
@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_tokens_past_a_stop_string_are_dropped_with_the_text(
        scripted_http, stop, text, kept, stream):
    body = {"prompt": [SCRIPT_START], "max_tokens": 30, "temperature": 0, "stop": [stop],
            "logprobs": 1, "return_tokens_as_token_ids": True}
    if stream:
        ids, got = [], ""
        with scripted_http.stream("POST", "/v1/completions",
                                  json={"stream": True, **body}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        got += c["text"]
                        if c["logprobs"]:
                            ids += _logprob_ids(c["logprobs"])
    else:
        choice = scripted_http.post("/v1/completions", json=body).json()["choices"][0]
        got, ids = choice["text"], _logprob_ids(choice["logprobs"])
    assert got == text
    assert ids == SCRIPT_IDS[:kept]


def test_stop_token_id_ends_with_stop_and_counts_but_is_not_text(scripted_http):
    from latentserve.models.checkpoint import load_tokenizer, resolve_model_dir

    r = scripted_http.post("/v1/completions", json={
        "prompt": [SCRIPT_START], "max_tokens": 30, "temperature": 0,
        "stop_token_ids": [SCRIPT_IDS[3]]}).json()
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["text"] == load_tokenizer(resolve_model_dir(None)).decode(SCRIPT_IDS[:3])
    assert r["usage"]["completion_tokens"] == 4  # the stop token was generated


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_min_p_and_top_k_filter_what_temperature_1_may_sample(scripted_http, seed):
    # At temperature 1 the ~49k tokens with logit 0 hold most of the mass; min_p 0.5 keeps
    # only the top token (the runner-up has e^-1 of its probability), top_k 2 the two best.
    assert _token_ids(scripted_http, 5, temperature=1.0, min_p=0.5, seed=seed) == \
        [B, A, B, A, B]
    ids = _token_ids(scripted_http, 6, temperature=1.0, top_k=2, seed=seed)
    prev = A
    for t in ids:
        if prev not in LOOP:  # X and Y leave the script: every logit is 0 after them
            break
        assert t in {nxt for nxt, _ in LOOP[prev]}, (prev, t)
        prev = t
