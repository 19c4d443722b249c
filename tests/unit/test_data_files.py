"""The test sets ship inside the package with their licences; a data directory
(``--data-dir`` or ``$LATENTSERVE_DATA``) is searched first; a file found nowhere is an error
naming the folders searched and where upstream to get it, before any model loads."""

import json

import pytest

from latentserve.eval.datasets import DATASETS, find_data_file, load_items, package_data_dir

SIZES = {"gsm8k": 1319, "gsm8k-icot": 1319, "prosqa": 500, "mult4": 1000, "mult5": 1000}


@pytest.fixture
def no_data_env(monkeypatch):
    monkeypatch.delenv("LATENTSERVE_DATA", raising=False)


@pytest.mark.parametrize("name", sorted(DATASETS))
def test_every_test_set_loads_from_the_package(no_data_env, name):
    items = load_items(name)
    assert len(items) == SIZES[name]
    assert all(i.question and i.gold for i in items)


def test_each_shipped_folder_carries_its_licence():
    root = package_data_dir()
    for folder in ("gsm8k", "prosqa", "multiplication"):
        assert "MIT License" in (root / folder / "LICENSE").read_text()
    assert "MIT License" in (root / "gsm8k" / "LICENSE-icot").read_text()  # test_icot.txt


def test_the_data_directory_is_searched_before_the_package(monkeypatch, tmp_path):
    (tmp_path / "gsm8k").mkdir()
    (tmp_path / "gsm8k" / "test.jsonl").write_text(
        json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}) + "\n")
    monkeypatch.setenv("LATENTSERVE_DATA", str(tmp_path))
    assert [i.gold for i in load_items("gsm8k")] == ["2"]
    assert len(load_items("prosqa")) == 500  # not in the directory: the package's
    monkeypatch.delenv("LATENTSERVE_DATA")
    assert [i.gold for i in load_items("gsm8k", data_dir=tmp_path)] == ["2"]


def test_a_file_that_does_not_ship_says_where_to_get_it(no_data_env):
    with pytest.raises(FileNotFoundError, match=r"data file gsm8k/train.jsonl not found in "
                       r".*pass --data-dir DIR or set LATENTSERVE_DATA to a directory holding "
                       r"gsm8k/train.jsonl, from github.com/openai/grade-school-math"):
        find_data_file("gsm8k/train.jsonl")


def test_train_head_without_train_data_fails_before_loading(no_data_env, capsys, tmp_path):
    from latentserve.cli import main

    rc = main(["train-head", "sft", "--model", str(tmp_path / "never-loaded"),
               "--out", str(tmp_path / "h.safetensors")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "gsm8k/train.jsonl not found" in err and "pass --data FILE or set" in err


def test_data_multiplication_excludes_the_shipped_sets(no_data_env, capsys, tmp_path):
    from latentserve.cli import main

    out = tmp_path / "train.txt"
    assert main(["data", "multiplication", "--k", "4", "--n", "20", "--out", str(out)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["n"] == 20 and len(out.read_text().splitlines()) == 20
    assert [p.rsplit("/", 1)[1] for p in report["excluded_from"]] == ["4x4_test.txt",
                                                                       "4x4_valid.txt"]
    held_out = {i.question for i in load_items("mult4")}
    assert not held_out & {line.partition("||")[0].strip()
                           for line in out.read_text().splitlines()}


def test_data_multiplication_without_evaluation_sets_says_to_pass_exclude(
        no_data_env, capsys, tmp_path):
    """``--k 3`` has no evaluation sets to leave out: the error says which --k lack them and
    what to pass, not where upstream to fetch files that do not exist there."""
    from latentserve.cli import main

    out = tmp_path / "train.txt"
    assert main(["data", "multiplication", "--k", "3", "--n", "5", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "--k 3: no evaluation sets multiplication/3x3_test.txt" in err
    assert "4x4 and 5x5 ship" in err and "--exclude /dev/null" in err
    assert "Internalize_CoT" not in err
    assert main(["data", "multiplication", "--k", "3", "--n", "5", "--out", str(out),
                 "--exclude", "/dev/null"]) == 0


def test_colar_eval_reads_its_dataset_from_the_package_before_loading(no_data_env, capsys,
                                                                      tmp_path):
    from latentserve.cli import main

    rc = main(["eval", "--model", str(tmp_path / "never-loaded"), "--prompt-format", "colar",
               "--dataset", "gsm8k"])
    assert rc == 2
    assert ("give --dataset gsm8k-icot|mult4|mult5 or --dataset-file FILE, got --dataset "
            "gsm8k") in capsys.readouterr().err


def test_data_multiplication_makes_the_folder_of_out(no_data_env, capsys, tmp_path):
    from latentserve.cli import main

    out = tmp_path / "new" / "train.txt"
    assert main(["data", "multiplication", "--k", "4", "--n", "3", "--out", str(out)]) == 0
    assert len(out.read_text().splitlines()) == 3


@pytest.mark.parametrize("args,message", [
    (["--k", "100000"], "need --k in [1, 30] and --n >= 0, got --k 100000"),
    (["--exclude", "README"], "README line 1 is not an iCoT line (question||steps #### answer)"),
    (["--exclude", "FIVE"], "FIVE holds no 4x4 question, so it would exclude nothing"),
    (["--exclude", "EMPTY"], "EMPTY holds no questions, so it would exclude nothing"),
    (["--out", "DIR"], "is an existing directory, but it names an iCoT data file"),
    (["--out", "FIVE/x.txt"], "FIVE is a file, not a folder, so an iCoT data file cannot")])
def test_data_multiplication_refuses_what_it_cannot_honour(no_data_env, capsys, tmp_path,
                                                            args, message):
    """A huge ``--k`` and an ``--exclude`` file that would leave nothing out (not iCoT, or
    another k's questions) are refused up front, naming the flag or the file."""
    from latentserve.cli import main

    (tmp_path / "README").write_text("# not a data file\n")
    five = load_items("mult5")[0]
    (tmp_path / "FIVE").write_text(f"{five.question}||1 #### 2\n")
    (tmp_path / "EMPTY").write_text("\n")
    (tmp_path / "DIR").mkdir()
    args = [str(tmp_path / a) if a in ("README", "FIVE", "EMPTY", "DIR", "FIVE/x.txt") else a
            for a in args]
    out = tmp_path / "train.txt"
    rc = main(["data", "multiplication", "--k", "4", "--n", "5", "--out", str(out), *args])
    assert rc == 2 and not out.exists()
    assert message in capsys.readouterr().err
