"""Several models in one server (``start_server([config, ...])``, ``latentserve serve --model
A --model B``): a plain tiny Llama, a COCONUT (feedback latent), a Huginn (recurrent depth)
and a LOTUS (looped block) model, one engine process each, served together.

Concurrent requests to all four, each with its own ``latent_budget``, get the greedy answers
of each model's eager reference; ``model`` routes every route (an unknown name is a 404
``model_not_found``, a missing one a 400 naming ``model``); ``/v1/models`` lists the four,
``/health`` and ``/metrics`` report each engine; no KV slot leaks in any engine; a killed
engine fails only its model's requests; stopping the server stops every engine process. An
in-process app with stand-in engines checks the same routing without engines."""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_testlib import MAX_MODEL_LEN, StandInClient, assert_slots_invariant, wait_idle

from latentserve.outputs import StepOutput

PROMPT = [11, 12, 13, 14, 15, 16, 17, 18]
MAX_TOKENS = 4
# Per model kind: the latent budgets sent at once (None: the model's default; plain: none).
BUDGETS = {"plain": [None, 0], "coconut": [0, 3], "huginn": [2, 5], "lotus": [1, 3]}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, smollm2_dir):
    from latentserve.bench.baseline.latent_models import save_latent_tiny
    from latentserve.bench.baseline.recurrent_models import write_huginn
    from latentserve.bench.baseline.tiny_models import save_tiny
    from tests.support.loop_models import save_loop_tiny

    root = tmp_path_factory.mktemp("multi-model")
    return {
        "plain": save_tiny(root / "plain-llama", "llama",
                           max_position_embeddings=MAX_MODEL_LEN),
        "coconut": save_latent_tiny(root / "coconut", "coconut-llama", max_budget=8),
        "huginn": write_huginn(root / "huginn"),
        "lotus": save_loop_tiny(root / "lotus", "lotus-llama", block_size=5, iterations=2),
    }


@pytest.fixture(scope="module")
def names(dirs):
    """kind -> served model name (the directory, as given)."""
    return {kind: str(d) for kind, d in dirs.items()}


@pytest.fixture(scope="module")
def multi_server(dirs):
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    configs = [EngineConfig(model=str(d), max_num_seqs=4, kv_slots=2048)
               for d in dirs.values()]
    srv = start_server(configs, timeout=300)
    yield srv
    srv.stop()


@pytest.fixture
def http(multi_server):
    with httpx.Client(base_url=multi_server.base_url, timeout=120) as c:
        yield c


def _body(model, budget=None, **fields):
    body = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "logprobs": 0, "return_tokens_as_token_ids": True, **fields}
    if budget is not None:
        body["latent_budget"] = budget
    return body


def _ids(choice) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]


def _reference(kind, model_dir, budget, hf_models) -> list[int]:
    """The greedy answer of ``kind``'s eager reference (no engine involved)."""
    import torch

    if kind == "plain":
        model, ids = hf_models(model_dir), list(PROMPT)
        with torch.no_grad():
            for _ in range(MAX_TOKENS):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        return ids[len(PROMPT):]
    if kind == "coconut":
        from tests.support.latent_reference import reference_generate

        return reference_generate(model_dir, PROMPT, budget, MAX_TOKENS, ignore_eos=True)[0]
    if kind == "huginn":
        from latentserve.bench.baseline.recurrent_reference import HuginnReference

        return HuginnReference(model_dir).generate(PROMPT, MAX_TOKENS, budget)["tokens"]
    from tests.support.loop_models import load_lotus_reference
    from tests.support.loop_reference import reference_generate_loop

    return reference_generate_loop(load_lotus_reference(str(model_dir)), PROMPT, budget,
                                   MAX_TOKENS, ignore_eos=True)[0]


def test_concurrent_requests_to_every_model_match_each_reference(http, dirs, names,
                                                                 hf_models):
    jobs = [(kind, b) for kind, budgets in BUDGETS.items() for b in budgets]
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = list(pool.map(
            lambda job: http.post("/v1/completions", json=_body(names[job[0]], job[1])),
            jobs))
    for (kind, budget), r in zip(jobs, replies):
        assert r.status_code == 200, (kind, budget, r.text)
        body = r.json()
        assert body["model"] == names[kind]
        want = _reference(kind, dirs[kind], budget, hf_models)
        assert _ids(body["choices"][0]) == want, (kind, budget)
        if kind in ("coconut", "lotus") and budget:
            assert body["choices"][0]["latent"]["steps"] > 0, (kind, body)
    assert_slots_invariant(wait_idle(http))


def test_models_lists_every_model_and_retrieves_each(http, names):
    r = http.get("/v1/models")
    assert r.status_code == 200
    listed = [m["id"] for m in r.json()["data"]]
    assert listed == list(names.values())
    for name in names.values():
        r = http.get(f"/v1/models/{name}")
        assert r.status_code == 200 and r.json()["id"] == name
    r = http.get("/v1/models/no-such-model")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_chat_and_messages_route_by_model(http, names):
    for kind in ("plain", "coconut"):
        r = http.post("/v1/chat/completions", json={
            "model": names[kind], "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 2, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["model"] == names[kind]
    r = http.post("/v1/messages", json={
        "model": names["plain"], "max_tokens": 2,
        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == names["plain"]


def test_tokenize_uses_the_named_models_tokenizer(http, dirs, names):
    from latentserve.models.checkpoint import load_tokenizer

    text = "hello world, latent reasoning"
    seen = {}
    for kind, name in names.items():
        tok = load_tokenizer(dirs[kind])
        want = list(tok.encode(text))
        r = http.post("/tokenize", json={"model": name, "prompt": text})
        assert r.status_code == 200, r.text
        assert r.json()["tokens"] == want, kind
        seen[kind] = want
        r = http.post("/detokenize", json={"model": name, "tokens": PROMPT})
        assert r.status_code == 200 and r.json()["prompt"] == tok.decode(PROMPT), kind
    assert seen["huginn"] != seen["plain"]  # a word tokenizer vs SmolLM2's: routing matters


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "max_tokens": 2}),
    ("/tokenize", {"prompt": "hi"}),
    ("/detokenize", {"tokens": [1, 2]}),
])
def test_unknown_model_is_404_and_missing_model_is_400(http, path, body):
    r = http.post(path, json={**body, "model": "no-such-model"})
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "model_not_found"
    assert r.json()["error"]["param"] == "model"
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "model"


def test_unknown_model_on_messages_is_an_anthropic_404(http):
    r = http.post("/v1/messages", json={"model": "no-such-model", "max_tokens": 2,
                                        "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 404
    assert r.json()["error"]["type"] == "not_found_error"


def test_health_and_metrics_report_every_engine(http, names):
    health = wait_idle(http)
    assert health["status"] == "ok" and health["ready"] is True
    assert [m["model"] for m in health["models"]] == list(names.values())
    assert all(m["status"] == "ok" and m["engine"] for m in health["models"])
    assert_slots_invariant(health)
    one = http.get("/health", params={"model": names["huginn"]})
    assert one.status_code == 200
    assert [m["model"] for m in one.json()["models"]] == [names["huginn"]]
    assert "kv_slots_total" in one.json()  # one model: its fields at the top level
    assert http.get("/health", params={"model": "nope"}).status_code == 404
    text = http.get("/metrics").text
    for name in names.values():
        assert f'latentserve_kv_slots_total{{model_name="{name}"}}' in text, name
    # Every family is written once (one HELP line), with one sample per model.
    assert text.count("# HELP latentserve_kv_slots_total ") == 1
    # The requests of the first test were counted under their own model.
    assert f'latentserve_request_success_total{{finished_reason="length",model_name="' \
           f'{names["huginn"]}"}}' in text


def test_a_killed_engine_fails_only_its_model_and_stop_ends_every_engine(multi_server,
                                                                         http, names):
    """Runs last on this server: one engine process is killed; requests to its model are
    503 ``engine_dead``, the other three keep serving, /health is 200 ``degraded``; then
    ``stop()`` ends every engine process."""
    import time

    import psutil
    from server_testlib import engine_processes

    engines = engine_processes(multi_server)
    assert len(engines) == 4, [p.cmdline() for p in engines]
    engines[0].kill()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        health = http.get("/health")
        if health.json()["status"] != "ok":
            break
        time.sleep(0.1)
    assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
    dead = [m["model"] for m in health.json()["models"] if m["status"] != "ok"]
    assert len(dead) == 1
    for name in names.values():
        r = http.post("/v1/completions", json=_body(name))
        if name in dead:
            assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        else:
            assert r.status_code == 200, (name, r.text)
    assert http.get("/health", params={"model": dead[0]}).status_code == 503
    assert multi_server.stop() is not None
    _, alive = psutil.wait_procs(engines, timeout=10)
    assert not alive


# --- without engines ------------------------------------------------------------------------


def test_same_name_twice_fails_at_start_up_naming_both_paths(tmp_path):
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    path = str(tmp_path / "m")
    with pytest.raises(ValueError, match="--model .*/m and --model .*/m"):
        start_server([EngineConfig(model=path), EngineConfig(model=path)])
    code = "import sys; from latentserve.cli import main; sys.exit(main(sys.argv[1:]))"
    done = subprocess.run([sys.executable, "-c", code, "serve", "--model", path, "--model",
                           str(tmp_path / "other"), "--model", path, "--port", "0"],
                          check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("latentserve: error: models 1 and 3 would both be served "
                                f"as '{path}' (--model {path} and --model {path})"), lines
    assert "Traceback" not in done.stderr


def test_a_model_that_cannot_load_fails_start_up_naming_it(tmp_path):
    code = "import sys; from latentserve.cli import main; sys.exit(main(sys.argv[1:]))"
    bad = str(tmp_path / "missing")
    other = tmp_path / "bad-config"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "no-such-arch"}')
    done = subprocess.run([sys.executable, "-c", code, "serve", "--model", str(other),
                           "--model", bad, "--port", "0"],
                          check=False, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(f"latentserve: error: EngineStartupError: {other}: engine "
                                "failed to start:"), lines[-1]
    assert "Traceback" not in done.stderr + done.stdout


class _StandIn(StandInClient):
    """An engine client that answers one token per request, or, with ``dead``, one whose
    engine process is gone."""

    def __init__(self, dead: bool = False):
        self.dead_reason = "engine process exited" if dead else None

    async def get_stats(self, timeout=5.0):
        return None if self.dead_reason else {"num_running": 0, "num_waiting": 0,
                                              "kv_slots_free": 8, "kv_slots_cached": 0,
                                              "kv_slots_total": 8}

    def abort_all(self):
        return 0

    async def generate(self, rid, prompt_ids, params):
        from latentserve.server.client import EngineDeadError

        if self.dead_reason:
            raise EngineDeadError(self.dead_reason)
        yield StepOutput(rid, [28], True, "length")


def test_a_dead_engine_fails_only_its_models_requests(smollm2_tokenizer):
    from fastapi.testclient import TestClient

    from latentserve.server.app import create_app
    from latentserve.server.state import ServerState

    states = [ServerState(_StandIn(), smollm2_tokenizer, "alive", 256, 49152),
              ServerState(_StandIn(dead=True), smollm2_tokenizer, "dead", 256, 49152)]
    with TestClient(create_app(states), raise_server_exceptions=False) as app:
        ok = app.post("/v1/completions", json={"model": "alive", "prompt": "hi",
                                                "max_tokens": 1})
        assert ok.status_code == 200 and ok.json()["model"] == "alive"
        r = app.post("/v1/completions", json={"model": "dead", "prompt": "hi",
                                               "max_tokens": 1})
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
        health = app.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded"
        assert [m["status"] for m in health.json()["models"]] == ["ok", "error"]
        assert app.get("/health", params={"model": "dead"}).status_code == 503
        assert app.get("/health", params={"model": "alive"}).status_code == 200
    with pytest.raises(ValueError, match="two models are served as 'alive'"):
        create_app([states[0], ServerState(_StandIn(), smollm2_tokenizer, "alive", 256)])
