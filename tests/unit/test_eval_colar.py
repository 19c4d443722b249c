"""``latentserve eval`` in the CoLaR prompt format (``cli/eval.py`` ``run_colar``,
``eval/colar_eval.py``) on tiny models: a random CoLaR directory
(``tests.support.colar_models.save_colar_tiny``) and a random compression head on a tiny
Llama (``tests.support.head_models.save_head_model``). ``--url`` is refused, a head's
default cap and the other controls are recorded as resolved, a sweep keeps every run's
records, its values are checked before the first run, and ``--plot`` works without
``--model``."""

import argparse
import json

import pytest

from latentserve.cli import main


@pytest.fixture(scope="module")
def colar_dir(tmp_path_factory):
    from tests.support.colar_models import save_colar_tiny

    return save_colar_tiny(tmp_path_factory.mktemp("evalcolar") / "m", stop_push=16.0)


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, smollm2_dir):
    from tests.support.head_models import save_head_model

    return save_head_model(tmp_path_factory.mktemp("evalhead") / "m", source_layer=1, seed=2)


@pytest.fixture
def words_file(tmp_path):
    """Two iCoT lines in the tiny CoLaR tokenizer's words."""
    p = tmp_path / "q.txt"
    p.write_text("w45 w46 w47||x #### 1\nw60 w61||x #### 2\n")
    return p


@pytest.fixture
def sums_file(tmp_path):
    """Two iCoT lines for the SmolLM2 tokenizer of the tiny head model."""
    p = tmp_path / "sums.txt"
    p.write_text("What is 2 + 3?||2 + 3 = 5 #### 5\nWhat is 4 + 4?||4 + 4 = 8 #### 8\n")
    return p


@pytest.mark.parametrize("how", ["auto", "flag"])
def test_url_is_refused_in_the_colar_format_before_loading(colar_dir, words_file, capsys,
                                                           tmp_path, how):
    """The CoLaR format runs in-process only: ``--url`` is an error naming it (it used to
    be ignored and the model evaluated in-process)."""
    out = tmp_path / "o.json"
    model = ["--model", str(colar_dir)] if how == "auto" else ["--prompt-format", "colar"]
    rc = main(["eval", "--url", "http://127.0.0.1:9/v1", *model, "--dataset-file",
               str(words_file), "--max-tokens", "2", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and not out.exists()
    assert "--url: the CoLaR prompt format" in err and "runs in-process only" in err
    assert ("holds colar_config.json" if how == "auto" else "(--prompt-format colar)") in err


def test_a_heads_default_cap_and_controls_are_recorded_as_run(head_dir, sums_file, tmp_path,
                                                              monkeypatch):
    """Without ``--max-latent`` a head in the CoLaR format thinks up to the engine's default
    cap (``LATENTSERVE_MAX_LATENT``); the summary records that cap (it said null), the
    answer budget and the controls as the engine resolved them."""
    monkeypatch.setenv("LATENTSERVE_MAX_LATENT", "3")
    res = tmp_path / "s.json"
    assert main(["eval", "--model", str(head_dir), "--prompt-format", "colar",
                 "--dataset-file", str(sums_file), "--max-tokens", "2", "--no-stop",
                 "--min-latent", "1", "--json-out", str(res)]) == 0
    s = json.loads(res.read_text())
    assert s["thinking"]["max"] == s["max_latent"] == 3  # --no-stop: every phase to the cap
    assert (s["max_tokens"], s["min_latent"], s["use_stop"], s["stop_threshold"]) == \
        (2, 1, False, 0.5)
    assert s["compression_factor"] is None and s["n"] == 2


def test_a_speed_sweep_keeps_every_runs_records(colar_dir, words_file, tmp_path):
    """``--out`` of a sweep holds each run's records under its value (only the last run's
    were kept), and every run records its resolved speed and cap."""
    out = tmp_path / "o.json"
    assert main(["eval", "--model", str(colar_dir), "--dataset-file", str(words_file),
                 "--max-tokens", "2", "--max-latent", "4", "--sweep",
                 "compression_factor=1,2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert sorted(data["records"]) == ["1", "2"]
    assert all(len(r) == 2 for r in data["records"].values())
    runs = data["summary"]["runs"]
    assert [(r["compression_factor"], r["max_latent"], r["max_tokens"]) for r in runs] == \
        [(1, 4, 2), (2, 4, 2)]
    for r, v in zip(runs, ("1", "2")):
        assert r["thinking"]["max"] == max(x["thinking"] for x in data["records"][v])


def test_every_sweep_value_is_checked_before_the_first_run(colar_dir, words_file, tmp_path,
                                                          capsys):
    """A speed above the model's range (5) is refused before c=2 runs, naming the value,
    as ``--compression-factor 9`` is; a repeated value is refused naming ``--sweep``."""
    out = tmp_path / "o.json"
    args = ["eval", "--model", str(colar_dir), "--dataset-file", str(words_file),
            "--max-tokens", "2", "--out", str(out)]
    assert main([*args, "--sweep", "compression_factor=2,9"]) == 2
    stdout, err = capsys.readouterr()
    assert "--sweep compression_factor=9: compression_factor must be in [1, 5] for this " \
           "model, got 9" in err
    assert stdout == "" and not out.exists()  # c=2 did not run
    assert main([*args, "--compression-factor", "9"]) == 2
    assert "compression_factor must be in [1, 5] for this model, got 9" in \
        capsys.readouterr().err
    assert main([*args, "--sweep", "compression_factor=2,2"]) == 2
    assert "--sweep compression_factor=2,2 repeats 2; give each value once" in \
        capsys.readouterr().err


def test_plot_without_model_names_the_embedded_model(head_dir, sums_file, tmp_path,
                                                     monkeypatch):
    """``--latent-head`` on the embedded model (no ``--model``) plots its sweep (it failed
    with a TypeError after the sweep). The tiny head model stands in for the embedded
    SmolLM2 (``engine_config`` patched) to keep the test fast."""
    pytest.importorskip("matplotlib")
    import latentserve.cli as cli

    real = cli.engine_config

    def tiny(args):
        assert args.model is None
        return real(argparse.Namespace(**{**vars(args), "model": str(head_dir)}))

    monkeypatch.setattr(cli, "engine_config", tiny)
    png = tmp_path / "p.png"
    assert main(["eval", "--prompt-format", "colar", "--latent-head",
                 str(head_dir / "latent_reasoning_head.safetensors"), "--dataset-file",
                 str(sums_file), "--limit", "1", "--sweep", "max_latent=0,1", "--plot",
                 str(png), "--max-tokens", "2"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_the_baseline_format_is_checked_before_loading(tmp_path, words_file, capsys):
    """A chat-format ``--out`` as the CoLaR format's ``--baseline`` is refused before the
    model loads (``--model`` names a missing directory the run would fail on)."""
    pytest.importorskip("matplotlib")
    chat = tmp_path / "cot.json"
    chat.write_text(json.dumps({"runs": [{"accuracy_flexible": 0.5, "accuracy_strict": 0.5,
                                          "thinking_median": 9}]}))
    rc = main(["eval", "--model", str(tmp_path / "none"), "--prompt-format", "colar",
               "--dataset-file", str(words_file), "--sweep", "max_latent=0,1", "--plot",
               str(tmp_path / "p.png"), "--baseline", str(chat)])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"--baseline {chat} is not a CoLaR-prompt-format run's --json-out summary" in err
    assert "it is a chat-prompt-format --out, which goes with --prompt-format chat" in err
