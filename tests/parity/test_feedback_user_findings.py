"""Regressions from a user's pass over feedback latent models (COCONUT, CODI, SIM-CoT):

* a DDP-saved (``module.``-prefixed) SIM-CoT COCONUT checkpoint, which docs/models.md says
  loads, made the eager reference (``latent_reference``) fail with "missing ... unexpected
  module.base_causallm..." while the engine loaded it;
* ``latentserve convert`` with a ``--base`` of another architecture (a GPT-2 checkpoint over
  a Llama base) wrote a directory that failed only at load ("unexpected weight");
* ``latentserve convert --default-budget -1`` failed after writing config, tokenizer and the
  checkpoint copy into ``--out``, so a retry needed ``--force``;
* a hand-assembled CODI directory whose ``latent_config.json`` leaves out ``prj`` (docs:
  ``null`` = no projection) loaded and silently fed the raw hidden back although the
  checkpoint has ``prj.*`` tensors: now refused naming ``prj`` with the dims to set.
"""

import json

import pytest
import torch

from latentserve.bench.baseline.latent_models import write_upstream_coconut
from latentserve.latent.convert import convert_coconut, convert_codi
from tests.support.latent_reference import reference_generate


@pytest.fixture(scope="module")
def upstream(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("feedback-user")
    gpt2_base, ckpt = write_upstream_coconut(root / "gpt2", "gpt2", prefix=True)
    llama_base, _ = write_upstream_coconut(root / "llama", "llama", prefix=True)
    return root, gpt2_base, ckpt, llama_base


def test_module_prefixed_simcot_checkpoint_reference_and_engine(upstream):
    from latentserve import LLM, SamplingParams

    root, base, ckpt, _ = upstream
    plain = convert_coconut(base, ckpt, root / "plain")
    sd = {"module." + k: v for k, v in torch.load(ckpt, weights_only=True).items()}
    sd["module.expainable_llm.lm_head.weight"] = torch.zeros(10, 4)  # SIM-CoT training-only
    sim_ckpt = root / "checkpoint_sim"
    torch.save(sd, sim_ckpt)
    sim = convert_coconut(base, sim_ckpt, root / "sim", variant="sim-cot", default_budget=3)
    prompt = [5, 6, 7, 8]
    want = reference_generate(plain, prompt, 3, 5)[0]
    assert reference_generate(sim, prompt, 3, 5)[0] == want
    llm = LLM(model=str(sim))
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert out.latent_steps == 3
    assert list(out.token_ids) == want[: len(out.token_ids)]


def test_convert_refuses_base_of_another_architecture(upstream):
    root, _, ckpt, llama_base = upstream
    out = root / "wrong"
    with pytest.raises(ValueError, match=r"does not fit --base .*wrong --base\?"):
        convert_coconut(llama_base, ckpt, out)
    assert not out.exists() or not any(out.iterdir())


def test_convert_bad_budget_writes_nothing(upstream):
    root, base, ckpt, _ = upstream
    out = root / "negative"
    with pytest.raises(ValueError, match="default_budget"):
        convert_coconut(base, ckpt, out, default_budget=-1)
    assert not out.exists()
    with pytest.raises(ValueError, match="default_budget"):
        convert_coconut(base, ckpt, out, default_budget=70)  # above max_budget 64
    assert not out.exists()
    assert (convert_coconut(base, ckpt, out, default_budget=2) / "latent_config.json").is_file()


def test_codi_prj_left_out_is_refused(tmp_path, smollm2_dir):
    pytest.importorskip("peft")
    from latentserve.bench.baseline.latent_models import write_upstream_codi
    from latentserve.latent.load import load_model

    base, ckpt = write_upstream_codi(tmp_path, "gpt2", "safetensors")
    model_dir = convert_codi(base, ckpt, tmp_path / "model", lora_alpha=16.0)
    path = model_dir / "latent_config.json"
    cfg = json.loads(path.read_text())
    assert cfg["prj"]["dim"] == 48
    path.write_text(json.dumps({k: v for k, v in cfg.items() if k != "prj"}))
    with pytest.raises(ValueError, match=r"'prj' is null but the checkpoint has prj\.\* "
                                         r"tensors.*\"dim\": 48"):
        load_model(model_dir, torch.float32, "cpu")
