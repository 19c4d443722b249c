"""``latentserve generate`` with a per-request latent budget: the printed text equals the
offline API's answer with the same budget, and a budget over the model's cap is one error
line naming the field."""

import pytest

from latentserve import LLM, SamplingParams
from latentserve.cli import main


def test_generate_takes_a_latent_budget(tmp_path, smollm2_dir, capsys):
    from latentserve.bench.baseline.latent_models import save_latent_tiny

    path = save_latent_tiny(tmp_path, "coconut-gpt2")
    assert main(["generate", "--model", str(path), "--prompt", "w5 w6 w7", "--raw",
                 "--max-tokens", "4", "--latent-budget", "2"]) == 0
    printed = capsys.readouterr().out.strip()
    llm = LLM(model=str(path))
    want = llm.generate(["w5 w6 w7"], SamplingParams(max_tokens=4, temperature=0,
                                                     latent_budget=2), use_tqdm=False)
    assert printed == want[0].outputs[0].text.strip()
    cap = llm.engine.latent_spec.max_budget
    assert main(["generate", "--model", str(path), "--prompt", "w5", "--raw",
                 "--latent-budget", str(cap + 1)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("latentserve: error: latent_budget") and err.count("\n") == 1


@pytest.mark.parametrize("flag", [["--exit-criterion", "kl"], ["--exit-threshold", "0.5"]])
def test_generate_exit_flags_on_a_plain_model_are_one_error_line(tiny_dirs, capsys, flag):
    assert main(["generate", "--model", str(tiny_dirs["llama"]), "--prompt", "w5", "--raw",
                 *flag]) == 2
    assert "needs a recurrent-depth model" in capsys.readouterr().err


def test_generate_takes_the_head_controls(tmp_path, capsys):
    from latentserve.bench.head_gpu import build_head_model

    path = build_head_model(tmp_path / "tiny", "tiny")
    argv = ["generate", "--model", str(path), "--prompt", "w9 w10", "--raw", "--max-tokens",
            "6", "--max-latent", "2", "--min-output-tokens", "0"]
    assert main(argv) == 0
    printed = capsys.readouterr().out.strip()
    # An explicit --max-tokens holds without --min-output-tokens too (no 4,096 floor).
    assert main(argv[:-2]) == 0
    assert capsys.readouterr().out.strip() == printed
    want = LLM(model=str(path)).generate(
        ["w9 w10"], SamplingParams(max_tokens=6, temperature=0, max_latent=2,
                                   min_output_tokens=0), use_tqdm=False)[0].outputs[0]
    assert printed == want.text.strip() and want.latent_stats["steps"] <= 2


def test_generate_with_max_tokens_on_a_colar_model(tmp_path, capsys):
    """README's ``generate ... --max-tokens N`` on a CoLaR model (models/smollm2-mult-colar):
    the implicit answer-budget floor of 0 is not sent to CoLaR, which takes no
    min_output_tokens (its max_tokens counts answer tokens only). Before: one error line,
    ``min_output_tokens is not a control of a CoLaR model``."""
    from tests.support.colar_models import save_colar_tiny

    path = save_colar_tiny(tmp_path / "colar")
    assert main(["generate", "--model", str(path), "--prompt", "w5 w6", "--raw",
                 "--max-tokens", "4"]) == 0
    out, err = capsys.readouterr()
    assert "error" not in err
    assert main(["generate", "--model", str(path), "--prompt", "w5", "--raw",
                 "--max-tokens", "4", "--min-output-tokens", "0"]) == 2  # asked for: refused
    assert "min_output_tokens is not a control" in capsys.readouterr().err


def test_a_latent_phase_that_takes_the_whole_budget_is_explained(tmp_path, capsys):
    """A head that never stops thinking within ``--max-tokens`` leaves no answer token: the
    empty answer comes with a note saying why and what to raise (before: an empty line)."""
    from tests.support.head_models import save_head_model

    path = save_head_model(tmp_path / "head", stop_bias=-20.0)  # never stops by itself
    assert main(["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "5"]) == 0
    out, err = capsys.readouterr()
    assert out == "\n"
    assert "the latent phase (5 steps) used the whole --max-tokens budget" in err
    assert "raise --max-tokens" in err and "--max-latent" in err
    assert main(["generate", "--model", str(path), "--prompt", "hi", "--max-tokens", "5",
                 "--max-latent", "2"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() and "note" not in err


def test_head_flags_on_a_model_without_a_head_are_one_error_line(tiny_dirs, capsys):
    assert main(["generate", "--model", str(tiny_dirs["llama"]), "--prompt", "w5", "--raw",
                 "--max-latent", "4"]) == 2
    assert "--max-latent needs a model with a compression head" in capsys.readouterr().err


def test_thinking_off_is_harmless_on_a_model_without_a_head(tiny_dirs, capsys):
    """As on the server (docs/server.md): thinking turned off is harmless on any model and
    makes the other head controls harmless too; only asking for thinking is refused."""
    base = ["generate", "--model", str(tiny_dirs["llama"]), "--prompt", "w5", "--raw",
            "--max-tokens", "3", "--temperature", "0"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    assert main([*base, "--thinking", "off"]) == 0
    assert capsys.readouterr().out == plain
    assert main([*base, "--thinking", "off", "--max-latent", "4"]) == 0
    assert capsys.readouterr().out == plain
    assert main([*base, "--thinking", "on"]) == 2
    assert "--thinking needs a model with a compression head" in capsys.readouterr().err


def test_generate_takes_token_ids_and_prints_ids_without_a_tokenizer(tmp_path, capsys):
    """A directory without tokenizer files: ``--prompt-token-ids`` runs and prints the
    output ids (those of the offline API); ``--prompt`` text is one error line saying why."""
    from latentserve.bench.baseline.recurrent_models import write_huginn

    d = write_huginn(tmp_path / "huginn")
    for f in d.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")) or f.suffix == ".jinja":
            f.unlink()
    assert main(["generate", "--model", str(d), "--prompt-token-ids", "5,6,7",
                 "--max-tokens", "3"]) == 0
    printed = [int(t) for t in capsys.readouterr().out.split()]
    want = LLM(model=str(d)).generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0),
                                      use_tqdm=False)[0].outputs[0].token_ids
    assert printed == list(want) and len(printed) > 0
    assert main(["generate", "--model", str(d), "--prompt", "hello"]) == 2
    assert "no tokenizer files" in capsys.readouterr().err
