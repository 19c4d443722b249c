"""``latentserve generate`` with a per-request latent budget: the printed text equals the
offline API's answer with the same budget, and a budget over the model's cap is one error
line naming the field."""

import pytest

from latentserve import LLM, SamplingParams
from latentserve.cli import main


def test_generate_takes_a_latent_budget(tmp_path, smollm2_dir, capsys):
    from latentserve.testing.latent_models import save_latent_tiny

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
