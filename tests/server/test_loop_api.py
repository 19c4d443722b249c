"""Looped-block models over HTTP (issue 8): a LOTUS checkpoint served on the OpenAI route;
each request's ``latent_budget`` (body or header) sets its pass count, concurrent requests
with different budgets share the engine's passes, answers equal the eager full-recomputation
reference, an over-cap budget is a 400 naming the field, and no KV slot leaks."""

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_testlib import assert_slots_invariant, wait_idle

PROMPT = [21, 22, 23, 24, 25, 26, 27]


@pytest.fixture(scope="module")
def lotus_dir(tmp_path_factory, smollm2_dir):
    from tests.support.loop_models import save_loop_tiny

    return save_loop_tiny(tmp_path_factory.mktemp("loop-api"), "lotus-llama", block_size=5,
                          iterations=2)


@pytest.fixture(scope="module")
def loop_server(lotus_dir):
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    srv = start_server(EngineConfig(model=str(lotus_dir), max_num_seqs=8), timeout=300)
    yield srv
    srv.stop()


def _complete(srv, body=None, headers=None):
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, **(body or {})}
    return httpx.post(f"{srv.base_url}/v1/completions", json=body, headers=headers or {},
                      timeout=120)


def test_concurrent_budgets_match_the_reference(loop_server, lotus_dir):
    from latentserve.models.checkpoint import load_tokenizer
    from tests.support.loop_models import load_lotus_reference
    from tests.support.loop_reference import reference_generate_loop

    budgets = [0, 1, 3, 2, 0, 4]
    with ThreadPoolExecutor(len(budgets)) as pool:
        replies = list(pool.map(lambda b: _complete(loop_server, {"latent_budget": b}), budgets))
    tok = load_tokenizer(lotus_dir)
    ref = load_lotus_reference(str(lotus_dir))
    for b, r in zip(budgets, replies):
        assert r.status_code == 200, r.text
        want, _ = reference_generate_loop(ref, PROMPT, b, 5)
        want = [t for t in want if t != tok.eos_token_id]
        assert r.json()["choices"][0]["text"] == tok.decode(want, skip_special_tokens=True)
    with httpx.Client(base_url=loop_server.base_url) as http:
        assert_slots_invariant(wait_idle(http))


def test_over_cap_budget_is_a_400_naming_it(loop_server):
    r = _complete(loop_server, None, {"x-latent-budget": "65"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "x-latent-budget"
    assert _complete(loop_server, {"latent_budget": 1}).status_code == 200


def test_context_check_counts_the_block_positions(loop_server, lotus_dir):
    """Prompt + start/block/end positions + max_tokens over max_model_len is the OpenAI
    context-length 400 naming max_tokens; one token less fits and runs to max_tokens. A
    negative budget is a 400 naming the model's range."""
    import json

    cfg = json.loads((lotus_dir / "latent_config.json").read_text())
    extra = 1 + cfg["block_size"] + 1 + len(cfg["answer_prompt_ids"])  # start, block, end
    card = httpx.get(f"{loop_server.base_url}/v1/models", timeout=30).json()["data"][0]
    fits = card["max_model_len"] - len(PROMPT) - extra
    r = _complete(loop_server, {"max_tokens": fits + 1, "latent_budget": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "max_tokens"
    assert f"{extra} latent and transition positions" in err["message"]
    ok = _complete(loop_server, {"max_tokens": fits, "latent_budget": 1, "ignore_eos": True})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["completion_tokens"] == fits
    r = _complete(loop_server, {"latent_budget": -1})
    assert r.status_code == 400, r.text
    assert f"[0, {cfg['max_budget']}]" in r.json()["error"]["message"]
    with httpx.Client(base_url=loop_server.base_url) as http:
        assert_slots_invariant(wait_idle(http))


def test_count_tokens_asks_room_for_one_answer_token(loop_server, lotus_dir):
    """Anthropic's count takes no max_tokens: a prompt whose start/block/end positions leave
    no room for one answer token is a 400 (context_length_exceeded) that names no
    max_tokens; one token shorter is counted, and /v1/messages refuses the longer too."""
    import json

    cfg = json.loads((lotus_dir / "latent_config.json").read_text())
    extra = 1 + cfg["block_size"] + 1 + len(cfg["answer_prompt_ids"])
    card = httpx.get(f"{loop_server.base_url}/v1/models", timeout=30).json()["data"][0]

    def post(route, content, **body):
        return httpx.post(f"{loop_server.base_url}/v1/messages{route}", timeout=60, json={
            "model": card["id"], "messages": [{"role": "user", "content": content}], **body})

    base = post("/count_tokens", "a").json()["input_tokens"]
    assert post("/count_tokens", "a a").json()["input_tokens"] == base + 1
    longest = card["max_model_len"] - extra - 1  # + extra + 1 answer token = max_model_len
    fits = post("/count_tokens", " ".join(["a"] * (longest - base + 1)))
    assert fits.status_code == 200 and fits.json()["input_tokens"] == longest, fits.text
    words = " ".join(["a"] * (longest - base + 2))
    r = post("/count_tokens", words)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "max_tokens" not in err["message"] and "prompt is too long" in err["message"]
    assert post("", words, max_tokens=1).status_code == 400
