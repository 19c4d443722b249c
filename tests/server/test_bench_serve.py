"""``latentserve bench serve`` against a live tiny server: a ShareGPT-format file, a
custom JSON-lines file, ``--dataset random`` on chat, ``--extra-body`` reaching the server
(a latent-budget sweep), ``--header``, and vLLM's flat result JSON written by
``--save-result --result-dir --result-filename``."""

import json

import pytest
from server_testlib import API_KEY

from latentserve.cli import main

# Two usable conversations and one whose answer is too short (under 4 tokens: skipped).
SHAREGPT = [
    {"id": "a", "conversations": [
        {"from": "human", "value": "Tell me a short story about a cat and a dog."},
        {"from": "gpt", "value": "Once upon a time a cat and a dog became friends."}]},
    {"id": "b", "conversations": [
        {"from": "human", "value": "What is the capital of France and why is it famous?"},
        {"from": "gpt", "value": "Paris is the capital of France, famous for its art."}]},
    {"id": "c", "conversations": [
        {"from": "human", "value": "Say yes or no, please, as you like it."},
        {"from": "gpt", "value": "Yes"}]},
    {"id": "d", "conversations": [{"from": "human", "value": "one turn only here"}]},
]


def bench(server_url: str, tmp_path, *argv: str) -> dict:
    """Run the benchmark; return its saved result."""
    assert main(["bench", "serve", "--base-url", server_url, "--num-prompts", "4",
                 "--save-result", "--result-dir", str(tmp_path / "out"),
                 "--result-filename", "r.json", *argv]) == 0
    return json.loads((tmp_path / "out" / "r.json").read_text())


def count(http, text: str) -> int:
    return http.post("/tokenize", json={"prompt": text}).json()["count"]


def test_sharegpt_file_sets_each_output_length_from_the_answer(server, http, tmp_path):
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(SHAREGPT))
    result = bench(server.base_url, tmp_path, "--api-key", API_KEY, "--dataset-name",
                   "sharegpt", "--dataset-path", str(path), "--endpoint", "/v1/completions")
    answers = {count(http, e["conversations"][1]["value"]) for e in SHAREGPT[:2]}
    prompts = {count(http, e["conversations"][0]["value"]) for e in SHAREGPT[:2]}
    assert result["completed"] == 4 and result["failed"] == 0
    assert set(result["output_lens"]) == answers  # 4 requests from the 2 usable entries
    assert set(result["input_lens"]) == prompts
    for key in ("mean_ttft_ms", "median_tpot_ms", "p99_itl_ms", "std_e2el_ms",
                "request_throughput", "output_throughput", "total_token_throughput",
                "duration", "total_input_tokens", "total_output_tokens", "ttfts", "itls",
                "generated_texts", "errors", "model_id", "endpoint_type", "num_prompts"):
        assert key in result, key
    assert result["total_output_tokens"] == sum(result["output_lens"])
    assert result["endpoint_type"] == "openai"
    assert len(result["ttfts"]) == 4 and all(t > 0 for t in result["ttfts"])


def test_custom_jsonl_and_random_chat(server, tmp_path):
    path = tmp_path / "custom.jsonl"
    path.write_text('{"prompt": "Hello there", "output_tokens": 3}\n'
                    '{"prompt": "A second prompt"}\n')
    result = bench(server.base_url, tmp_path, "--api-key", API_KEY, "--dataset", "custom",
                   "--dataset-path", str(path), "--custom-output-len", "5")
    assert sorted(set(result["output_lens"])) == [3, 5]
    result = bench(server.base_url, tmp_path, "--api-key", API_KEY, "--dataset", "random",
                   "--random-input-len", "16", "--random-output-len", "2")
    assert result["completed"] == 4 and result["output_lens"] == [2, 2, 2, 2]
    assert result["endpoint_type"] == "openai-chat"


def test_header_is_sent(server, tmp_path, capsys, monkeypatch):
    """The key as ``--header``: the run succeeds; without it the server refuses."""
    monkeypatch.delenv("LATENTSERVE_API_KEY", raising=False)
    result = bench(server.base_url, tmp_path, "--header", f"Authorization=Bearer {API_KEY}",
                   "--output-len", "1")
    assert result["completed"] == 4
    assert main(["bench", "serve", "--base-url", server.base_url, "--num-prompts", "1"]) == 2
    assert "answered 401" in capsys.readouterr().err


def test_vllm_host_port_and_backend_flags(server, tmp_path):
    """``vllm bench serve --backend vllm --host H --port P`` as vLLM's docs write it: the
    server from --host/--port, /v1/completions from --backend vllm."""
    from urllib.parse import urlsplit

    url = urlsplit(server.base_url)
    assert main(["bench", "serve", "--backend", "vllm", "--host", url.hostname, "--port",
                 str(url.port), "--api-key", API_KEY, "--num-prompts", "2", "--output-len",
                 "1", "--json-out", str(tmp_path / "r.json")]) == 0
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 2 and result["endpoint"] == "/v1/completions"
    assert result["endpoint_type"] == "openai"
    assert f"--base-url {server.base_url}" in result["command"]


@pytest.fixture(scope="module")
def latent_server(tmp_path_factory, smollm2_dir):
    from latentserve.bench.baseline.latent_models import save_latent_tiny
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    path = save_latent_tiny(tmp_path_factory.mktemp("bench"), "coconut-llama", max_budget=8)
    srv = start_server(EngineConfig(model=str(path), max_num_seqs=8), timeout=300,
                       log_requests=True)
    yield srv
    srv.stop()


def test_extra_body_sweeps_a_latent_budget(latent_server, tmp_path, capsys):
    result = bench(latent_server.base_url, tmp_path, "--extra-body", '{"latent_budget": 4}',
                   "--output-len", "2")
    assert result["completed"] == 4 and result["extra_body"] == {"latent_budget": 4}
    assert "latent_budget=4" in latent_server.log_tail(200_000)  # the request log
    # Over the model's cap (8): every request is refused, naming the field.
    assert main(["bench", "serve", "--base-url", latent_server.base_url, "--num-prompts",
                 "2", "--extra-body", '{"latent_budget": 99}', "--json-out",
                 str(tmp_path / "over.json")]) == 1
    over = json.loads((tmp_path / "over.json").read_text())
    assert over["completed"] == 0 and over["failed"] == 2
    assert all("latent_budget" in e for e in over["errors"])
    # The reason is printed, not only saved in the JSON (vLLM prints its failed request's).
    err = capsys.readouterr().err
    assert err.count("failed request: HTTP 400") == 1 and "latent_budget" in err


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "sharegpt"], "--dataset sharegpt needs --dataset-path FILE"),
    (["--extra-body", "[1]"], "argument --extra-body: must be a JSON object"),
    (["--header", "novalue"], "argument --header: must be KEY=VALUE"),
])
def test_bad_flags_are_one_error_naming_the_flag(server, capsys, argv, message):
    code = None
    try:
        code = main(["bench", "serve", "--base-url", server.base_url, "--api-key", API_KEY,
                     *argv])
    except SystemExit as done:
        code = done.code
    assert code == 2
    assert message in capsys.readouterr().err
