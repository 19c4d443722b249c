"""``latentserve eval --url``: the OpenAI-compatible backend against a live server over a
tiny Llama with a compression head; latent steps come from the server's ``latent.steps``
and the summary equals a count over the records."""

import json

import pytest

from latentserve.eval.backends import OpenAIBackend
from latentserve.eval.datasets import load_items
from latentserve.eval.run import evaluate


@pytest.fixture(scope="module")
def head_server(tmp_path_factory, smollm2_dir):
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server
    from tests.support.head_models import save_head_model

    d = save_head_model(tmp_path_factory.mktemp("evalurl") / "m", source_layer=1, seed=4)
    srv = start_server(EngineConfig(model=str(d), max_num_seqs=4), timeout=300)
    yield srv
    srv.stop()


def test_url_backend_reports_latent_steps_from_the_server(head_server, tmp_path):
    data = tmp_path / "test.jsonl"
    rows = [{"question": f"What is {a} + {a}?", "answer": f"{a}+{a}=<<{a}+{a}={2 * a}>>"
             f"{2 * a}\n#### {2 * a}"} for a in (2, 5, 7)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    items = load_items("gsm8k", data)
    backend = OpenAIBackend(head_server.base_url + "/v1", concurrency=2)
    records, summary = evaluate(items, backend, max_tokens=4, max_latent=3, use_stop=False)
    assert [r["latent_steps"] for r in records] == [3, 3, 3]
    assert (summary["thinking_median"], summary["thinking_max"], summary["n"]) == (3, 3, 3)
    assert summary["latent_end"] == {"cap": 3}  # use_stop off: every phase hits its cap
    # the controls as the server resolved them (latent.stats), the answer budget as given
    assert (summary["use_stop"], summary["max_tokens"]) == (False, 4)
    assert summary["min_latent"] is not None and summary["stop_threshold"] is not None
    assert all(r["completion_tokens"] > 0 for r in records)
    assert summary["accuracy_flexible"] == sum(r["flexible"] for r in records) / 3


def test_url_backend_text_mode_turns_thinking_off_on_a_head_server(head_server, tmp_path):
    """Without max_latent the backend asks for thinking off (the server's default with a
    head is thinking on, with its 4096-token answer floor): no latent steps, and the answer
    stays within max_tokens."""
    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"question": "What is 2 + 2?",
                                "answer": "2+2=<<2+2=4>>4\n#### 4"}) + "\n")
    backend = OpenAIBackend(head_server.base_url + "/v1", concurrency=1)
    records, _ = evaluate(load_items("gsm8k", data), backend, max_tokens=5)
    assert records[0]["latent_steps"] == 0
    assert 0 < records[0]["completion_tokens"] <= 5


@pytest.mark.parametrize("suffix", ["", "/", "/v1", "/v1/"])
def test_eval_cli_takes_the_server_url_with_or_without_v1(head_server, tmp_path, capsys,
                                                          suffix):
    """``eval --url`` takes the server's root (``/v1`` is added when the root answers 404)
    and its ``/v1`` base URL, with or without a trailing slash."""
    from latentserve.cli import main

    data = tmp_path / "test.jsonl"
    data.write_text(json.dumps({"question": "What is 2 + 2?",
                                "answer": "2+2=<<2+2=4>>4\n#### 4"}) + "\n")
    rc = main(["eval", "--url", head_server.base_url + suffix, "--dataset", "gsm8k",
               "--data-file", str(data), "--max-tokens", "3"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert '"n": 1' in out


def test_eval_cli_url_without_a_server_says_what_it_tried(tmp_path, capsys):
    from latentserve.cli import main
    from latentserve.server.launch import listen_socket

    sock = listen_socket("127.0.0.1", 0)  # bound, never listening: connections are refused
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        assert main(["eval", "--url", url, "--dataset", "mult4", "--limit", "1"]) == 2
    finally:
        sock.close()
    err = capsys.readouterr().err
    assert f"--url {url}: no OpenAI-compatible server answered GET {url}/models" in err
    assert "e.g. http://127.0.0.1:8000/v1" in err
