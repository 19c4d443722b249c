"""A command that needs an optional dependency which is not installed fails at once, before
loading a model or reading data, with one line naming the extra that installs it."""

import sys

import pytest

from latentserve.cli import main


@pytest.mark.parametrize("module, argv, words", [
    ("peft", ["train", "cot", "--data", "never-read.txt", "--out", "x"],
     ("latentserve train cot (LoRA; --lora-r 0 is a full fine-tune) needs peft, which is not "
      "installed: pip install 'latentserve[train]'")),
    ("peft", ["train", "colar", "--data", "never-read.txt", "--out", "x"],
     "latentserve train colar (LoRA; --lora-r 0 is a full fine-tune) needs peft"),
    ("peft", ["train", "colar-grpo", "--model", "never-loaded", "--data", "never-read.txt",
              "--out", "x"], "latentserve train colar-grpo needs peft"),
    ("peft", ["bench", "--suite", "loop"],
     ("bench --suite loop (it builds a PCCoT checkpoint) needs peft, which is not installed: "
      "pip install 'latentserve[train]'")),
    ("sglang_router", ["serve", "--model", "never-loaded", "--data-parallel-size", "2"],
     ("--data-parallel-size needs sglang-router, which is not installed: pip install "
      "'latentserve[router]'")),
    ("matplotlib", ["eval", "--model", "never-loaded", "--sweep", "max_latent=0,2", "--plot",
                    "p.png"],
     "--plot needs matplotlib, which is not installed: pip install 'latentserve[eval]'"),
])
def test_a_missing_extra_is_named_before_any_work(monkeypatch, capsys, module, argv, words):
    monkeypatch.setitem(sys.modules, module, None)  # import MODULE -> ImportError
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"latentserve: error: {words}"), err
    assert err.count("\n") == 1


def test_train_cot_full_fine_tune_does_not_ask_for_peft(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "peft", None)
    assert main(["train", "cot", "--lora-r", "0", "--data", "no-such-file.txt",
                 "--out", "x"]) == 2
    assert "no-such-file.txt does not exist" in capsys.readouterr().err  # got past the check


@pytest.mark.parametrize("builder", ["latent_models.write_upstream_codi",
                                     "loop_models.write_upstream_pccot"])
def test_test_checkpoint_builders_name_the_extra(monkeypatch, tmp_path, builder):
    import importlib

    module, name = builder.split(".")
    fn = getattr(importlib.import_module(f"latentserve.bench.baseline.{module}"), name)
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ModuleNotFoundError, match=r"needs peft, .*latentserve\[train\]"):
        fn(tmp_path)
    assert not any(tmp_path.iterdir())  # nothing written
