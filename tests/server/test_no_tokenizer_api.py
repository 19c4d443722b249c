"""A model directory without tokenizer files over HTTP (a tiny Huginn holding only
``config.json`` and weights): a token-id completions prompt is served, streamed or not, with
the reference's tokens (read back as ``token_id:N`` logprobs) and empty text; a text prompt,
chat, a stop string, ``/tokenize`` and ``/detokenize`` are 400s saying that the directory has
no tokenizer files."""

import json

import httpx
import pytest
from server_testlib import assert_slots_invariant, wait_idle

PROMPT = [(7 * i + 11) % 900 + 20 for i in range(12)]
MAX_TOKENS = 5
DEPTH = 4  # the checkpoint's mean_recurrence
NO_TOKENIZER = "this model directory has no tokenizer files; send token ids"


@pytest.fixture(scope="module")
def bare_huginn(tmp_path_factory):
    from latentserve.bench.baseline.recurrent_models import write_huginn

    d = write_huginn(tmp_path_factory.mktemp("no-tokenizer-api") / "huginn")
    for f in d.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            f.unlink()
    return d


@pytest.fixture(scope="module")
def http(bare_huginn):
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    srv = start_server(EngineConfig(model=str(bare_huginn), max_num_seqs=4, kv_slots=2048),
                       timeout=300)
    with httpx.Client(base_url=srv.base_url, timeout=120) as c:
        yield c
    srv.stop()


def _body(**fields):
    return {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, "return_tokens_as_token_ids": True, **fields}


def _ids(logprobs) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]


@pytest.mark.parametrize("stream", [False, True])
def test_token_id_prompt_gives_the_reference_tokens(http, bare_huginn, stream):
    from latentserve.bench.baseline.recurrent_reference import HuginnReference

    ref = HuginnReference(bare_huginn).generate(PROMPT, MAX_TOKENS, DEPTH)["tokens"]
    if stream:
        ids, text = [], ""
        with http.stream("POST", "/v1/completions", json=_body(stream=True)) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        ids += _ids(c["logprobs"]) if c["logprobs"] else []
                        text += c["text"]
    else:
        r = http.post("/v1/completions", json=_body())
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        ids, text = _ids(choice["logprobs"]), choice["text"]
    assert (ids, text) == (ref, "")
    assert_slots_invariant(wait_idle(http))


@pytest.mark.parametrize("route,body", [
    ("/v1/completions", _body(prompt="What is 2 + 3?")),
    ("/v1/completions", _body(prompt=["a", "b"])),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2}),
    ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ("/tokenize", {"prompt": "hi"}),
])
def test_text_is_a_400_saying_the_directory_has_no_tokenizer(http, bare_huginn, route, body):
    if route == "/v1/messages":  # Anthropic's body names the model
        body = {**body, "model": str(bare_huginn)}
    r = http.post(route, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert NO_TOKENIZER in err["message"], err


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_is_a_400_naming_stop_token_ids(http, stream):
    r = http.post("/v1/completions", json=_body(stop=["x"], stream=stream))
    assert r.status_code == 400, r.text
    assert "use stop_token_ids" in r.json()["error"]["message"]
    assert_slots_invariant(wait_idle(http))


def test_detokenize_is_a_400(http):
    r = http.post("/detokenize", json={"tokens": [5, 6]})
    assert r.status_code == 400 and "no tokenizer files" in r.json()["error"]["message"]
