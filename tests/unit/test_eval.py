"""``latentserve eval`` (eval/): data sets in their upstream formats, answer extraction
(strict ``#### N`` and flexible last number; digits; ProsQA options), summaries equal to a
hand count over scripted outputs, the in-process engine backend on a tiny head model, and
the CLI sweep with its plot."""

import json

import pytest

from latentserve.eval.answers import last_number, score, strict_number
from latentserve.eval.backends import Completion
from latentserve.eval.datasets import load_items
from latentserve.eval.run import evaluate, parse_sweep

GSM_ROWS = [("Ann has 3 pens and buys 4. How many?", "She has 3+4=<<3+4=7>>7.\n#### 7"),
            ("A box holds 1,200 nails; 200 are used. How many are left?",
             "1200-200=<<1200-200=1000>>1000\n#### 1000"),
            ("Bo earns $5 a day for 6 days. How much?", "5*6=<<5*6=30>>30\n#### 30"),
            ("Cy reads 10 pages a day for 3 days. Pages?", "10*3=<<10*3=30>>30\n#### 30"),
            ("Di has 9 cats and gives away 2. Cats?", "9-2=<<9-2=7>>7\n#### 7")]


@pytest.fixture
def gsm_file(tmp_path):
    p = tmp_path / "test.jsonl"
    p.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in GSM_ROWS))
    return p


def test_datasets_load_in_their_upstream_formats(tmp_path, gsm_file):
    items = load_items("gsm8k", gsm_file)
    assert [i.gold for i in items] == ["7", "1000", "30", "30", "7"]
    assert items[0].question == GSM_ROWS[0][0] and items[0].kind == "number"
    icot = tmp_path / "icot.txt"
    icot.write_text("Q one?||<<2*3=6>> <<6+1=7>> #### 7\nQ two?||<<1+1=2>> #### 2\n")
    assert [(i.question, i.gold, i.steps) for i in load_items("gsm8k-icot", icot)] == \
        [("Q one?", "7", "<<2*3=6>> <<6+1=7>>"), ("Q two?", "2", "<<1+1=2>>")]
    mult = tmp_path / "mult.txt"
    mult.write_text("1 2 * 3 0||3 6 #### 3 6 0 0\n")
    m = load_items("mult4", mult)[0]
    assert (m.question, m.gold, m.kind) == ("1 2 * 3 0", "3 6 0 0", "digits")
    pq = tmp_path / "prosqa.json"
    pq.write_text(json.dumps([{"question": "Every a is b. Is Bob a wumpus or yumpus?",
                               "answer": "Bob is a yumpus.", "steps": ["s1", "s2"]}]))
    assert load_items("prosqa", pq)[0].steps == "s1 s2"
    assert len(load_items("gsm8k", gsm_file, limit=2)) == 2
    with pytest.raises(ValueError, match="dataset must be one of"):
        load_items("mmlu", gsm_file)
    bad = tmp_path / "bad.txt"
    bad.write_text("no separator here\n")
    with pytest.raises(ValueError, match="bad.txt:1"):
        load_items("gsm8k-icot", bad)


def test_number_extraction_strict_and_flexible():
    assert strict_number("so #### 1,000.") == "1,000"
    assert strict_number("the answer is 1000") is None
    assert last_number("first 3, then $1,250.50 total.") == "$1,250.50"
    assert score("number", "3 + 4 = 7\n#### 7", "7") == (True, True)
    assert score("number", "#### 7 but then 8", "7") == (True, False)
    assert score("number", "It is 1,000.", "1000") == (False, True)
    assert score("number", "no number", "7") == (False, False)


def test_digits_and_prosqa_extraction():
    assert score("digits", "partial 3 6 #### 3 6 0 0", "3 6 0 0") == (True, True)
    assert score("digits", "it is 3 6 0 0", "3 6 0 0") == (False, True)
    assert score("digits", "#### 8501", "8 5 0 1") == (True, True)  # unspaced digits too
    q = "Every a is b. Is Bob a wumpus or yumpus?"
    assert score("prosqa", "Bob is a wumpus, so ... #### Bob is a yumpus.", "Bob is a yumpus.",
                 q) == (True, True)
    assert score("prosqa", "Bob is a yumpus. No wait, wumpus", "Bob is a yumpus.", q) == \
        (True, False)
    with pytest.raises(ValueError, match="answer kind"):
        score("boolean", "x", "y")


class ScriptedBackend:
    """Returns fixed outputs in order, as a server would."""

    def __init__(self, outs):
        self.outs, self.seen = outs, []

    def run(self, requests, **controls):
        self.seen = requests
        return self.outs[:len(requests)]


def test_summary_equals_a_hand_count(gsm_file):
    items = load_items("gsm8k", gsm_file)
    # per item: (text, completion tokens, latency); golds 7, 1000, 30, 30, 7
    script = [("3+4=7 #### 7", 12, 0.5),            # strict + flexible
              ("1200-200 = 1,000", 30, 1.5),        # flexible only
              ("#### 30, or maybe 31", 7, 0.25),    # strict only
              ("I do not know", 50, 2.0),           # neither
              ("9 - 2 = 7. #### 7.", 9, 1.0)]       # strict + flexible
    backend = ScriptedBackend([Completion(t, n, 0, s) for t, n, s in script])
    records, summary = evaluate(items, backend, max_tokens=64)
    strict_ok = [True, False, True, False, True]
    flex_ok = [True, True, False, False, True]
    tokens = sorted(n for _, n, _ in script)
    lat = sorted(s for _, _, s in script)
    assert summary["n"] == 5
    assert summary["accuracy_strict"] == sum(strict_ok) / 5
    assert summary["accuracy_flexible"] == sum(flex_ok) / 5
    assert summary["thinking_median"] == tokens[2] and summary["thinking_max"] == tokens[-1]
    assert summary["latency_median_s"] == lat[2] and summary["latency_max_s"] == lat[-1]
    assert [r["strict"] for r in records] == strict_ok
    # text CoT asks for '#### <number>'; a latent run sends the bare question
    assert all("####" in r.user and r.max_latent is None for r in backend.seen)
    evaluate(items, backend, max_tokens=8, max_latent=4)
    assert [(r.user, r.max_latent) for r in backend.seen] == [(i.question, 4) for i in items]


@pytest.fixture(scope="module")
def head_dir(tmp_path_factory, smollm2_dir):
    from tests.support.head_models import save_head_model

    return save_head_model(tmp_path_factory.mktemp("eval") / "m", source_layer=1, seed=2)


def test_engine_backend_counts_latent_steps_and_answer_tokens(head_dir, gsm_file):
    from latentserve.eval.backends import EngineBackend

    items = load_items("gsm8k", gsm_file, limit=3)
    backend = EngineBackend(model=str(head_dir))
    _, summary = evaluate(items, backend, max_tokens=5, max_latent=3, use_stop=False)
    # no stop head: every request runs its cap of 3 latent steps, then up to 5 tokens
    assert summary["thinking_median"] == 3 and summary["thinking_max"] == 3
    assert summary["latent_end"] == {"cap": 3}
    assert summary["completion_tokens_mean"] <= 5
    records, summary = evaluate(items, backend, max_tokens=5)  # thinking off
    assert all(r["latent_steps"] == 0 for r in records)
    assert summary["thinking_max"] == max(r["completion_tokens"] for r in records) <= 5
    e = backend.engine.cache
    assert e.allocator.num_free + e.radix.total_size() == e.allocator.num_total


def test_cli_sweep_writes_runs_and_a_plot(head_dir, gsm_file, tmp_path):
    from latentserve.cli import main

    out, png = tmp_path / "eval.json", tmp_path / "eval.png"
    rc = main(["eval", "--model", str(head_dir), "--dataset", "gsm8k", "--data-file",
               str(gsm_file), "--limit", "2", "--max-tokens", "3", "--no-stop",
               "--sweep", "max_latent=0,2", "--out", str(out), "--plot", str(png)])
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    assert [(r["max_latent"], r["thinking_max"], r["n"]) for r in runs] == [(0, 0, 2), (2, 2, 2)]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the settings and the file read are recorded, the controls as the engine resolved them
    data = json.loads(out.read_text())
    assert data["dataset_file"] == str(gsm_file) and sorted(data["records"]) == ["0", "2"]
    for r in runs:
        assert (r["dataset_file"], r["max_tokens"], r["use_stop"]) == (str(gsm_file), 3, False)
        assert r["min_latent"] is not None and r["stop_threshold"] is not None


def test_cli_records_the_head_controls_it_was_given(head_dir, gsm_file, tmp_path):
    """Two runs that differ only in ``--min-latent`` / ``--stop-threshold`` differ in their
    summaries (they looked identical)."""
    from latentserve.cli import main

    out = tmp_path / "eval.json"
    assert main(["eval", "--model", str(head_dir), "--dataset", "gsm8k", "--data-file",
                 str(gsm_file), "--limit", "1", "--max-tokens", "2", "--max-latent", "3",
                 "--min-latent", "2", "--stop-threshold", "0.25", "--out", str(out)]) == 0
    (run,) = json.loads(out.read_text())["runs"]
    assert (run["max_latent"], run["min_latent"], run["stop_threshold"], run["use_stop"],
            run["max_tokens"]) == (3, 2, 0.25, True, 2)


def test_cli_checks_every_budget_before_the_first_run(head_dir, gsm_file, tmp_path, capsys):
    """``--min-latent 3`` above the sweep's second budget (2) is refused before the first
    budget (5) runs, naming the value."""
    from latentserve.cli import main

    out = tmp_path / "eval.json"
    rc = main(["eval", "--model", str(head_dir), "--dataset", "gsm8k", "--data-file",
               str(gsm_file), "--limit", "1", "--max-tokens", "2", "--min-latent", "3",
               "--sweep", "max_latent=5,2", "--out", str(out)])
    stdout, err = capsys.readouterr()
    assert rc == 2 and stdout == "" and not out.exists()
    assert "--sweep max_latent=2: min_latent must be at most max_latent (2), got 3" in err


def test_plot_without_matplotlib_is_refused_before_any_work(monkeypatch, capsys, tmp_path):
    """``--plot`` names the extra to install, before loading a model or running a sweep."""
    import sys

    from latentserve.cli import main

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc = main(["eval", "--model", str(tmp_path / "not-loaded"), "--dataset", "gsm8k",
               "--sweep", "max_latent=0,2", "--plot", str(tmp_path / "p.png")])
    assert rc == 2
    assert ("--plot needs matplotlib, which is not installed: pip install 'latentserve[eval]'"
            in capsys.readouterr().err)


def test_parse_sweep_rejects_bad_specs():
    assert parse_sweep("max_latent=0,4,16") == ("max_latent", [0, 4, 16])
    assert parse_sweep("compression_factor=1,5", ("compression_factor", "max_latent")) == (
        "compression_factor", [1, 5])
    for bad in ("budget=1,2", "max_latent=a", "max_latent=", "max_latent=-1", "max_latent=1,,2"):
        with pytest.raises(ValueError, match="sweep"):
            parse_sweep(bad)
    # each run is recorded under its value: a value given twice is refused
    with pytest.raises(ValueError, match=r"^--sweep max_latent=2,4,2 repeats 2; give each "):
        parse_sweep("max_latent=2,4,2")
    # the range of the value's own flag (--compression-factor: >= 1)
    with pytest.raises(ValueError, match=r"^--sweep compression_factor=\.\.\.: "
                                         r"compression_factor must be >= 1, got 0"):
        parse_sweep("compression_factor=0,2", ("compression_factor", "max_latent"))


def test_answer_length_does_not_grow_with_unused_latent_budget(head_dir, gsm_file):
    """A stop head that ends thinking early leaves latent budget unused; the answer still
    gets at most max_tokens tokens (else a bigger budget would mean longer answers)."""
    from latentserve.eval.backends import EngineBackend

    items = load_items("gsm8k", gsm_file, limit=3)
    backend = EngineBackend(model=str(head_dir))
    records, _ = evaluate(items, backend, max_tokens=4, max_latent=20, use_stop=True,
                          stop_threshold=0.0, min_latent=1)
    assert all(r["latent_steps"] == 1 for r in records)  # threshold 0: stops at min_latent
    assert all(0 < r["completion_tokens"] <= 4 for r in records)


def test_a_file_of_another_data_set_is_a_clear_error(tmp_path, gsm_file):
    from latentserve.eval.datasets import parse_file

    prosqa = tmp_path / "p.json"
    prosqa.write_text(json.dumps([{"question": "q", "answer": "a", "steps": []}]))
    with pytest.raises(ValueError, match=f"{prosqa} is not a gsm8k data file"):
        load_items("gsm8k", prosqa)
    with pytest.raises(ValueError, match="is not a prosqa data file"):
        load_items("prosqa", gsm_file)
    with pytest.raises(ValueError, match=f"{prosqa}:1: not a GSM8K jsonl line"):
        parse_file(prosqa, "jsonl", "number", None)


@pytest.mark.parametrize("extra,words", [
    (["--plot", "p.png"], "--plot needs --sweep"),
    (["--sweep", "max_latent=0,2", "--max-latent", "4"], "give one"),
    (["--min-latent", "3", "--no-stop"], "--min-latent, --no-stop control a compression "
                                         "head's latent phase, which runs only with"),
    (["--stop-threshold", "0.5"], "--stop-threshold controls a compression head's"),
    (["--url", "http://127.0.0.1:9/v1"], "--url http://127.0.0.1:9/v1: no OpenAI-compatible"),
    (["--model", "no/such/dir", "--sweep", "compression_factor=1,2"],
     "(--model no/such/dir does not exist)"),
    (["--model", ".", "--json-out", "s.json"], "(--model . is not one)"),
    (["--compression-factor", "2"], "the embedded SmolLM2 is not one"),
    (["--json-out", "s.json"], "--json-out needs the CoLaR prompt format"),
    (["--out", "no/such/dir/o.json"], "--out no/such/dir/o.json: its folder no/such/dir does "
                                      "not exist"),
    (["--out", "."], "--out '.' is not a file path"),
    (["--out", ""], "--out '' is not a file path"),
    (["--out", "gone/"], "--out 'gone/' is not a file path"),
    (["--out", "README.md/o.json"], "--out README.md/o.json: its folder README.md is not a "
                                    "folder"),
    (["--out", "o.json", "--json-out", "o.json"], "--json-out o.json is also --out's file"),
    (["--sweep", "max_latent=0", "--plot", "gone/p.png"], "--plot gone/p.png: its folder"),
    (["--data-file", "."], "--dataset-file . is a folder; give a file"),
    (["--baseline", "README.md"], "--baseline is a reference line on --plot's sweep plot"),
    (["--api-model", "m"], "--api-model is for the server at --url"),
    (["--api-key", "k"], "--api-key is for the server at --url"),
    (["--concurrency", "4"], "--concurrency is for the server at --url"),
    (["--data-dir", "no/such/dir"], "--data-dir no/such/dir does not exist; give a folder"),
    (["--url", "http://127.0.0.1:9/v1", "--model", "."], "--model is for an in-process "
                                                       "engine; with --url the server's"),
    (["--url", "http://127.0.0.1:9/v1", "--latent-head", "h.safetensors"],
     "--latent-head is for an in-process engine"),
    (["--url", "http://127.0.0.1:9/v1", "--max-model-len", "64"],
     "--max-model-len is for an in-process engine"),
])
def test_cli_refuses_bad_options_before_running_naming_them(gsm_file, capsys, extra, words,
                                                           monkeypatch, tmp_path):
    from latentserve.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "README.md").write_text("a file, not a folder\n")
    rc = main(["eval", "--dataset", "gsm8k", "--data-file", str(gsm_file), "--limit", "1",
               *extra])
    err = capsys.readouterr().err
    assert rc != 0 and words in err and "Traceback" not in err
    assert {p.name for p in tmp_path.iterdir()} <= {"README.md", gsm_file.name}  # no output


def test_cli_refuses_an_output_over_the_data_file(gsm_file, capsys):
    from latentserve.cli import main

    before = gsm_file.read_text()
    rc = main(["eval", "--dataset", "gsm8k", "--data-file", str(gsm_file), "--out",
               str(gsm_file)])
    assert rc == 2 and gsm_file.read_text() == before
    assert f"--out {gsm_file} is also --dataset-file's file" in capsys.readouterr().err


def test_a_colar_baseline_is_refused_before_a_chat_sweep(gsm_file, tmp_path, capsys):
    """The chat format's ``--baseline`` is a chat ``--out``; a CoLaR ``--json-out`` is
    refused naming the flag before the model loads (it was a KeyError after the sweep)."""
    pytest.importorskip("matplotlib")
    from latentserve.cli import main

    colar = tmp_path / "r.json"
    colar.write_text(json.dumps({"n": 1, "accuracy": 0.5, "thinking": {"median": 3}}))
    rc = main(["eval", "--model", str(tmp_path / "none"), "--dataset", "gsm8k",
               "--data-file", str(gsm_file), "--sweep", "max_latent=0", "--plot",
               str(tmp_path / "p.png"), "--baseline", str(colar)])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"--baseline {colar} is not a chat-prompt-format run's --out JSON" in err
    assert "it is a CoLaR-prompt-format summary, which goes with --prompt-format colar" in err


def test_a_data_dir_that_does_not_exist_is_refused(tmp_path, monkeypatch, capsys):
    """``--data-dir`` or ``$LATENTSERVE_DATA`` naming no folder is an error naming it (it
    fell back to the packaged data without a word), for ``eval`` and ``data``."""
    from latentserve.cli import main
    from latentserve.eval.datasets import find_data_file

    gone = tmp_path / "gone"
    monkeypatch.delenv("LATENTSERVE_DATA", raising=False)
    with pytest.raises(FileNotFoundError, match=f"^--data-dir {gone} does not exist; give a"):
        find_data_file("prosqa/test.json", gone)
    monkeypatch.setenv("LATENTSERVE_DATA", str(gone))
    with pytest.raises(FileNotFoundError,
                       match=rf"^\$LATENTSERVE_DATA \({gone}\) does not exist"):
        load_items("prosqa", limit=1)
    (tmp_path / "f").write_text("")
    monkeypatch.delenv("LATENTSERVE_DATA")
    with pytest.raises(FileNotFoundError, match="/f is not a folder"):
        find_data_file("prosqa/test.json", tmp_path / "f")
    assert main(["data", "multiplication", "--k", "4", "--n", "5", "--out",
                 str(tmp_path / "x.txt"), "--data-dir", str(gone)]) == 2
    assert f"--data-dir {gone} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "x.txt").exists()
