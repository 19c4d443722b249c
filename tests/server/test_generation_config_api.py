"""The server applies the model's ``generation_config.json`` sampling defaults to the
fields a request leaves unset (vLLM's ``--generation-config auto``); fields the request
sets win. The scripted model's two-token loop (A -> B or X, B -> A or Y) samples
differently per seed at temperature 1 unless ``top_k`` is 1."""

import json
import shutil

import httpx
import pytest
from server_testlib import A


@pytest.fixture(scope="module")
def base_url(scripted_model_dir, tmp_path_factory):
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    d = shutil.copytree(scripted_model_dir, tmp_path_factory.mktemp("gen") / "m")
    path = d / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "top_k": 1,
                                "max_new_tokens": 6}))
    srv = start_server(EngineConfig(model=str(d), max_num_seqs=4), timeout=300)
    yield srv.base_url
    srv.stop()


def completion(base_url, **fields):
    body = {"prompt": [A], "temperature": 1.0, "ignore_eos": True, "logprobs": 0, **fields}
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["logprobs"]["tokens"], choice


def test_top_k_1_from_the_generation_config_makes_seeds_agree(base_url):
    runs = [completion(base_url, seed=s, max_tokens=8)[0] for s in range(1, 6)]
    assert all(run == runs[0] for run in runs)
    assert len(runs[0]) == 8


def test_a_requests_top_k_overrides_the_generation_config(base_url):
    runs = [tuple(completion(base_url, seed=s, max_tokens=8, top_k=50)[0])
            for s in range(1, 6)]
    assert len(set(runs)) > 1


def test_an_unset_max_tokens_takes_max_new_tokens(base_url):
    tokens, choice = completion(base_url, seed=1)
    assert len(tokens) == 6 and choice["finish_reason"] == "length"


def test_chat_takes_the_defaults_too(base_url):
    """An unset ``max_tokens`` on chat is the generation config's ``max_new_tokens``."""
    r = httpx.post(f"{base_url}/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 6
