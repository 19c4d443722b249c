"""A vLLM launch line runs unchanged but for the program name, and each of its flags takes
effect: the served names (listed with ``root``, accepted in ``model``, the first one
answered), ``--tokenizer`` (the model directory has none), ``--chat-template`` (a file),
``--seed``, ``--dtype auto`` (float32 on the CPU), ``--trust-remote-code`` (ignored, with a
note), ``--no-enable-prefix-caching``, ``--max-model-len``, ``--uvicorn-log-level``
(no access log) and ``--enable-log-requests``."""

import shlex
import subprocess
import sys
import time

import httpx
import pytest

TEMPLATE = "{% for m in messages %}CUSTOM:{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def launched(tiny_model_dir, smollm2_dir, tmp_path_factory):
    """The server of the launch line, its base URL, model path and log file."""
    from latentserve.server.launch import free_port

    tmp = tmp_path_factory.mktemp("launch")
    model = tmp / "no-tokenizer"  # the tiny model's weights without its tokenizer files
    model.mkdir()
    for name in ("config.json", "generation_config.json", "model.safetensors"):
        (model / name).symlink_to(tiny_model_dir / name)
    template = tmp / "template.jinja"
    template.write_text(TEMPLATE)
    port = free_port()
    line = (f"vllm serve {model} --served-model-name tiny tiny-alias --tokenizer {smollm2_dir} "
            f"--chat-template {template} --seed 7 --dtype auto --trust-remote-code "
            f"--no-enable-prefix-caching --max-model-len 128 --max-num-seqs 4 "
            f"--gpu-memory-utilization 0.5 --tensor-parallel-size 1 "
            f"--uvicorn-log-level warning --enable-log-requests --host 127.0.0.1 "
            f"--port {port}")
    argv = shlex.split(line)
    assert argv[0] == "vllm"
    log_path = tmp / "server.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "latentserve.cli", *argv[1:]],
                                stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.25)
        else:
            raise AssertionError(f"server not up: {log_path.read_text()[-3000:]}")
        yield base, str(model), log_path
    finally:
        proc.terminate()
        proc.wait(60)


def test_served_names_are_listed_with_root_and_accepted(launched):
    base, model, _ = launched
    cards = httpx.get(f"{base}/v1/models").json()["data"]
    assert [c["id"] for c in cards] == ["tiny", "tiny-alias"]
    assert {c["root"] for c in cards} == {model}
    assert {c["max_model_len"] for c in cards} == {128}  # --max-model-len
    r = httpx.post(f"{base}/v1/completions", json={"model": "tiny-alias", "prompt": "Hi",
                                                   "max_tokens": 2}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "tiny"
    assert httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "Hi",
                                                      "max_tokens": 1}).status_code == 404


def test_tokenizer_and_chat_template_take_effect(launched):
    """The model directory has no tokenizer: text works through --tokenizer's, and chat
    messages render with --chat-template's file."""
    base, _, _ = launched
    chat = httpx.post(f"{base}/tokenize", json={
        "messages": [{"role": "user", "content": "hello"}],
        "add_generation_prompt": False}).json()["tokens"]
    text = httpx.post(f"{base}/tokenize", json={"prompt": "CUSTOM:hello",
                                                "add_special_tokens": False}).json()["tokens"]
    assert chat == text and len(text) > 1


def test_prefix_caching_is_off(launched):
    base, _, _ = launched
    prompt = list(range(100, 140))
    for _ in range(2):
        assert httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                          timeout=60).status_code == 200
    metrics = httpx.get(f"{base}/metrics").text
    hits = [line for line in metrics.splitlines()
            if line.startswith("latentserve_prefix_cache_hits_total{")]
    assert hits and all(line.endswith(" 0.0") for line in hits), hits


def test_engine_flags_log_levels_and_request_log(launched):
    base, _, log_path = launched
    httpx.post(f"{base}/v1/completions", json={"prompt": "Logged", "max_tokens": 1},
               timeout=60)
    log = log_path.read_text()
    config = next(line for line in log.splitlines() if "engine config of tiny:" in line)
    for field in ("served_model_name=('tiny', 'tiny-alias')", "seed=7", "device='cpu'",
                  "dtype='float32'", "enable_prefix_caching=False", "max_num_seqs=4",
                  "gpu_memory_utilization=0.5", "max_model_len=128"):
        assert field in config, field
    assert "--trust-remote-code is ignored" in log
    assert "Received request" in log and "'Logged'" in log  # --enable-log-requests
    assert "POST /v1/completions" not in log  # --uvicorn-log-level warning: no access log
