"""``latentserve demo`` (cli/demo.py) against tiny stand-ins for its two models, found by
name in a ``--models-dir``: for ``smollm2-mult-cot`` the scripted Llama of
``server_testlib`` (SmolLM2's tokenizer), which after the prompt's ``###`` writes ``7 8``,
``#`` ``##`` (the closing separator in two tokens), ``Answer:5``, EOS; for
``smollm2-mult-colar`` ``save_colar_tiny`` (random, its policy leaning towards ``###``),
whose answers and latent steps the offline ``LLM`` gives. One server (started by the demo's
``start_verbose``) serves both for the module; each demo run gets it in place of starting its
own, and the test checks which models the demo asked for."""

from contextlib import contextmanager
from itertools import pairwise

import pytest
from server_testlib import EOS, save_scripted

SEP, SEVEN, SPACE, EIGHT, HASH, HASH2, ANSWER, COLON, FIVE = (
    3757, 39, 216, 40, 19, 712, 21350, 42, 37)
CHAIN = [SEP, SEVEN, SPACE, EIGHT, HASH, HASH2, ANSWER, COLON, FIVE, EOS]
TEXT_THINKING = 3  # "7", " ", "8" come before the "###" written as "#" "##"
MAX_TOKENS = 9  # the scripted text is 8 tokens and EOS
QUESTIONS = ("1 2 * 3 4", "5 6 * 7 8")


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_dir):
    """``(both, text_only)``: a models directory with the two stand-ins, one with the text
    model alone."""
    from tests.support.colar_models import save_colar_tiny

    both = tmp_path_factory.mktemp("demo-both")
    script = {cur: [(nxt, 10.0)] for cur, nxt in pairwise(CHAIN)}
    save_scripted(both / "smollm2-mult-cot", script)
    save_colar_tiny(both / "smollm2-mult-colar", stop_push=16.0, compression_factor=2,
                    max_latent=6)
    text_only = tmp_path_factory.mktemp("demo-text-only")
    (text_only / "smollm2-mult-cot").symlink_to(both / "smollm2-mult-cot")
    return both, text_only


@pytest.fixture(scope="module")
def colar_truth(models):
    """Per question of QUESTIONS: the tiny CoLaR model's answer text and latent stats, from
    the offline engine (greedy, its default speed 2)."""
    from latentserve import LLM, SamplingParams
    from latentserve.latent import colar

    llm = LLM(model=str(models[0] / "smollm2-mult-colar"))
    outs = llm.generate([colar.QUESTION.format(q) for q in QUESTIONS],
                        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [(o.outputs[0].text.strip(), o.outputs[0].latent_stats) for o in outs]


@pytest.fixture(scope="module")
def shared_server(models):
    from latentserve.cli.demo import start_verbose
    from latentserve.config import EngineConfig

    configs = [EngineConfig(model=str(models[0] / name), max_num_seqs=4)
               for name in ("smollm2-mult-cot", "smollm2-mult-colar")]
    srv = start_verbose(configs, ["text CoT model", "CoLaR model"])
    yield srv
    srv.stop()


@pytest.fixture
def asked(shared_server, monkeypatch):
    """The model paths the demo asks to serve (filled when it runs); the shared server
    stands in for the one it would start."""
    paths = []

    @contextmanager
    def reuse(configs, labels):
        paths.extend(c.model for c in configs)
        yield shared_server

    monkeypatch.setattr("latentserve.cli.demo.start_verbose", reuse)
    return paths


def _demo(capsys, models_dir, questions_file) -> list[str]:
    from latentserve.cli import main

    rc = main(["demo", "--models-dir", str(models_dir), "--questions", str(questions_file),
               "--num-questions", "2", "--max-tokens", str(MAX_TOKENS),
               "--max-num-seqs", "4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    return out.splitlines()


def _rows(lines: list[str]) -> list[list[str]]:
    """The table's question rows, each split into its ``|`` columns (stripped)."""
    return [[c.strip() for c in line.split("|")] for line in lines
            if line[:1].isdigit() and "|" in line]


def test_table_has_each_models_answer_correctness_and_thinking(models, colar_truth, asked,
                                                                capsys, tmp_path):
    (answer1, stats1), (answer2, stats2) = colar_truth
    assert stats1["end"] != stats2["end"]  # one capped, one stopped by "###": both shown
    qfile = tmp_path / "q.txt"  # question 1's gold is the text model's, 2's the CoLaR's
    qfile.write_text(f"{QUESTIONS[0]}||s #### 5\n{QUESTIONS[1]}||s #### {answer2}\n")
    lines = _demo(capsys, models[0], qfile)
    assert asked == [str(models[0] / "smollm2-mult-cot"), str(models[0] / "smollm2-mult-colar")]
    assert not any(line.startswith("note:") for line in lines)
    header = next(line for line in lines if line.startswith("#"))
    assert "text CoT (smollm2-mult-cot)" in header and "CoLaR c=2" in header
    rows = _rows(lines)
    assert [r[0].split()[1:4] for r in rows] == [["21", "x", "43"], ["65", "x", "87"]]
    (_, text1, colar1), (_, text2, colar2) = rows
    assert text1.split()[:4] == ["5", "right", str(TEXT_THINKING), "tokens"]
    assert text2.split()[:4] == ["5", "WRONG", str(TEXT_THINKING), "tokens"]
    for cell, answer, stats, verdict in ((colar1, answer1, stats1, "WRONG"),
                                         (colar2, answer2, stats2, "right")):
        assert cell.startswith(answer[:12])
        steps = f"{stats['steps']} steps" + ("" if stats["end"] == "stop" else "+")
        assert f" {verdict} " in cell and f" {steps} " in cell
    summary = next(line for line in lines if line.startswith("total:"))
    steps = stats1["steps"] + stats2["steps"]
    assert (f"text CoT 1/2 right, {2 * TEXT_THINKING} thinking tokens" in summary
            and f"CoLaR 1/2 right, {steps} latent steps" in summary)


def test_without_the_colar_model_the_text_column_comes_alone_after_a_note(models, asked,
                                                                          capsys, tmp_path):
    qfile = tmp_path / "q.txt"
    qfile.write_text(f"{QUESTIONS[0]}||s #### 5\n{QUESTIONS[1]}||s #### 8 7\n")
    lines = _demo(capsys, models[1], qfile)
    assert asked == [str(models[0] / "smollm2-mult-cot")]  # the link, resolved
    notes = [line for line in lines if line.startswith("note:")]
    assert len(notes) == 1 and "smollm2-mult-colar" in notes[0]
    assert "scripts/stage1_gpu.sh" in notes[0]
    assert all(len(r) == 2 for r in _rows(lines)) and len(_rows(lines)) == 2
    assert [r[1].split()[:3] for r in _rows(lines)] == [["5", "right", "3"],
                                                        ["5", "WRONG", "3"]]
    summary = next(line for line in lines if line.startswith("total:"))
    assert "CoLaR" not in summary and "text CoT 1/2 right" in summary


def test_thinking_counts_the_tokens_wholly_before_the_separator():
    from latentserve.cli.demo import thinking_tokens

    assert thinking_tokens(["7", " ", "8", "###", "Answer", ":", "5"]) == 3
    assert thinking_tokens(["7", "#", "##", "Answer"]) == 1
    assert thinking_tokens(["7", " 8"]) is None


@pytest.mark.parametrize("argv,words", [
    (["--model", "m", "--questions", "q.txt"], "--questions is for the multiplication demo, "
                                               "not with --model"),
    (["--model", "m", "--compression-factor", "2"], "--compression-factor is for the"),
    (["--model", "m", "--models-dir", "d"], "--models-dir is for the multiplication demo"),
    (["--max-tokens", "0"], "argument --max-tokens: must be >= 1, got 0"),
    (["--compression-factor", "0"], "argument --compression-factor: must be >= 1, got 0"),
])
def test_flags_it_would_ignore_or_that_are_out_of_range_are_refused_first(argv, words, capsys):
    from latentserve.cli import main

    try:
        rc = main(["demo", *argv])
    except SystemExit as e:  # argparse's own refusal
        rc = e.code
    assert rc != 0 and words in capsys.readouterr().err


def test_a_speed_above_the_models_range_is_refused_before_serving(models, capsys, monkeypatch):
    from latentserve.cli import main

    monkeypatch.setattr("latentserve.cli.demo.start_verbose", None)  # never reached
    rc = main(["demo", "--models-dir", str(models[0]), "--compression-factor", "9"])
    assert rc != 0
    assert "--compression-factor must be in [1, " in capsys.readouterr().err


def test_a_speed_without_the_colar_model_or_a_models_dir_without_models_is_refused(
        models, capsys, tmp_path):
    from latentserve.cli import main

    assert main(["demo", "--models-dir", str(models[1]), "--compression-factor", "2"]) != 0
    assert "--compression-factor is CoLaR's speed, and" in capsys.readouterr().err
    assert main(["demo", "--models-dir", str(tmp_path)]) != 0
    assert f"--models-dir {tmp_path} holds no smollm2-mult-cot" in capsys.readouterr().err
