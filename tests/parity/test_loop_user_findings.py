"""Regressions from a user's pass over looped latent blocks (PCCoT, LOTUS): malformed
``latent_config.json`` values are refused at load naming the field (they used to load and then
fail the first request inside the engine, or silently change the LoRA scale), an answer
prompt id outside the embedding is blamed on ``answer_prompt_ids``, and ``convert pccot``
refuses a ``--max-budget`` below the adapter's ``num_iterations`` instead of silently raising
it (before writing anything)."""

import json
import shutil

import pytest
import torch

from latentserve.latent.load import load_model
from latentserve.latent.loop_checkpoint import prepare_loop_weights, validate_loop_config
from latentserve.latent.loop_convert import convert_pccot

CFG = {"format_version": 1, "family": "pccot", "checkpoint": None,
       "tokens": {"bot": 1, "eot": 2, "latent": 3}, "answer_prompt_ids": [4, 5],
       "block_size": 4, "default_budget": 2, "max_budget": 8,
       "lora": {"r": 8, "alpha": 16.0, "use_rslora": False}, "prj": {"eps": 1e-5}}


@pytest.fixture(scope="module")
def pccot_dirs(tmp_path_factory, smollm2_dir):
    pytest.importorskip("peft")  # inside: peft imports triton
    from tests.support.loop_models import save_loop_tiny

    root = tmp_path_factory.mktemp("loop-user")
    model = save_loop_tiny(root, "pccot-llama", block_size=3, iterations=2)
    return root / "base", root / "adapter", model


@pytest.mark.parametrize("change, field", [
    ({"prj": {"eps": "x"}}, "prj.eps"),        # loaded, then TypeError in the first pass
    ({"prj": {"eps": -1.0}}, "prj.eps"),       # LayerNorm with a negative eps
    ({"prj": {"eps": 0}}, "prj.eps"),
    ({"lora": {"r": 8, "alpha": 16.0, "use_rslora": "false"}}, "lora.use_rslora"),  # truthy
    ({"format_version": True}, "format_version"),  # True == 1
])
def test_malformed_loop_config_values_are_refused_naming_the_field(change, field):
    with pytest.raises(ValueError, match=f"field '{field}'"):
        validate_loop_config({**CFG, **change})


def test_well_formed_values_still_validate():
    cfg = validate_loop_config({**CFG, "prj": {"eps": 1e-6}, "lora": {"r": 4, "alpha": 8}})
    assert cfg["prj"]["eps"] == 1e-6 and cfg["lora"]["use_rslora"] is False


def test_bad_prj_eps_fails_at_load_not_in_the_first_request(pccot_dirs, tmp_path):
    *_, model = pccot_dirs
    broken = tmp_path / "model"
    shutil.copytree(model, broken)
    cfg = json.loads((broken / "latent_config.json").read_text())
    cfg["prj"]["eps"] = "x"
    (broken / "latent_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="prj.eps"):
        load_model(broken, torch.float32, "cpu")


def test_answer_prompt_id_outside_the_embedding_names_answer_prompt_ids(pccot_dirs):
    *_, model = pccot_dirs
    from transformers import AutoConfig

    cfg = validate_loop_config(json.loads((model / "latent_config.json").read_text()), model)
    cfg["answer_prompt_ids"] = [10 ** 6]
    hf = AutoConfig.from_pretrained(model, local_files_only=True)
    with pytest.raises(ValueError, match="field 'answer_prompt_ids'"):
        prepare_loop_weights(model, hf, cfg)


@pytest.mark.parametrize("max_budget", [1, -5])
def test_convert_refuses_a_max_budget_below_num_iterations(pccot_dirs, tmp_path, max_budget):
    base, adapter, _ = pccot_dirs
    out = tmp_path / "out"
    with pytest.raises(ValueError, match="--max-budget .*num_iterations \\(2"):
        convert_pccot(base, adapter, out, max_budget=max_budget)
    assert not out.exists()  # refused before anything was written


def test_convert_keeps_an_explicit_cap_and_defaults_to_64(pccot_dirs, tmp_path):
    base, adapter, _ = pccot_dirs
    for cap, want in ((2, 2), (None, 64)):
        out = convert_pccot(base, adapter, tmp_path / f"out{cap}", max_budget=cap)
        cfg = json.loads((out / "latent_config.json").read_text())
        assert (cfg["default_budget"], cfg["max_budget"]) == (2, want)


def _lotus_with_prj(root):
    from safetensors.torch import save_file

    from tests.support.loop_models import write_lotus

    model = write_lotus(root, block_size=3, iterations=2)
    d = json.loads((model / "config.json").read_text())["hidden_size"]
    g = torch.Generator().manual_seed(7)
    save_file({"prj.0.weight": torch.randn(d, d, generator=g) * 0.3,
               "prj.0.bias": torch.randn(d, generator=g) * 0.1,
               "prj.2.weight": torch.randn(d, d, generator=g) * 0.3,
               "prj.2.bias": torch.randn(d, generator=g) * 0.1,
               "prj.3.weight": 1 + torch.randn(d, generator=g) * 0.3,
               "prj.3.bias": torch.randn(d, generator=g) * 0.1},
              str(model / "prj.safetensors"))
    cfg = json.loads((model / "latent_config.json").read_text())
    cfg["prj"] = {"eps": 1e-5}
    (model / "latent_config.json").write_text(json.dumps(cfg))
    return model


def test_lotus_reference_applies_the_checkpoints_prj(tmp_path, smollm2_dir):
    """docs/models.md: LOTUS ``prj`` is optional; the reference used identity regardless, so it
    disagreed with the engine (which applies prj) for any budget >= 1."""
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.sampling_params import SamplingParams
    from tests.support.loop_models import load_lotus_reference
    from tests.support.loop_reference import reference_generate_loop

    model = _lotus_with_prj(tmp_path)
    ref = load_lotus_reference(str(model))
    assert isinstance(ref.prj, torch.nn.Module)
    engine = LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32"))
    prompt = [5, 6, 7, 8]
    for budget in (0, 1, 3):
        engine.add_request(f"b{budget}", prompt, SamplingParams(
            max_tokens=4, temperature=0.0, latent_budget=budget, ignore_eos=True))
        got = []
        while engine.has_unfinished_requests():
            got += [t for o in engine.step() for t in o.new_token_ids]
        assert got == reference_generate_loop(ref, prompt, budget, 4, ignore_eos=True)[0]
    engine.cache.check_idle()


def test_lotus_reference_refuses_weights_it_would_not_read(tmp_path, smollm2_dir):
    from tests.support.loop_models import load_lotus_reference, write_lotus

    model = write_lotus(tmp_path, block_size=2, iterations=1)
    cfg = json.loads((model / "latent_config.json").read_text())
    cfg["lora"] = {"r": 4, "alpha": 8.0}
    (model / "latent_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="'lora'"):
        load_lotus_reference(str(model))


def test_latent_trace_of_a_looped_model_has_an_entry_per_block_position(tmp_path,
                                                                         smollm2_dir):
    """return_latent_trace was silently ignored for looped blocks; it now returns each
    pass's logit lens per block position (tests/parity/test_loop_parity.py checks the
    values)."""
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.sampling_params import SamplingParams
    from tests.support.loop_models import save_loop_tiny

    path = save_loop_tiny(tmp_path, "lotus-llama", block_size=3, iterations=1)
    engine = LLMEngine(EngineConfig(model=str(path)))
    engine.add_request("a", [21, 22, 23], SamplingParams(max_tokens=1, latent_budget=1,
                                                         return_latent_trace=True))
    final = [o for _ in range(20) for o in engine.step() if o.finished]
    assert [(e["pass"], e["position"]) for e in final[0].latent_trace] == [
        (p, j) for p in (1, 2) for j in (1, 2, 3)]
    engine.cache.check_idle()


def test_running_requests_are_ordered_prefill_then_passes_then_decode():
    """The issue's priority order for a step's token budget: prefill -> loop passes ->
    decode (each group in arrival order)."""
    from types import SimpleNamespace

    from latentserve.latent.loop import passes_first

    def req(name, computed, prompt, outputs, looped=True, answered=False):
        return SimpleNamespace(name=name, num_computed=computed, prompt_ids=[0] * prompt,
                               output_ids=[0] * outputs, answer_start=3 if answered else None,
                               state=SimpleNamespace(block_size=4) if looped else None)

    decode = req("decode", 12, 8, 6, answered=True)
    in_pass = req("pass", 12, 8, 4)
    prefill = req("prefill", 3, 8, 0)
    plain = req("plain", 9, 9, 2, looped=False)
    in_pass2 = req("pass2", 10, 6, 4)
    order = passes_first([decode, in_pass, prefill, plain, in_pass2])
    assert [r.name for r in order] == ["prefill", "pass", "pass2", "decode", "plain"]
    assert passes_first([decode, plain]) == [decode, plain]  # no pass: unchanged


@pytest.mark.parametrize("family,flag", [("pccot", ["--default-budget", "0"]),
                                         ("pccot", ["--checkpoint", "x"]),
                                         ("pccot", ["--lora-alpha", "16"]),
                                         ("coconut", ["--adapter", "x"]),
                                         ("coconut", ["--keep-eos"]),
                                         ("codi", ["--adapter", "x"])])
def test_convert_refuses_a_flag_its_form_does_not_read(tmp_path, family, flag, capsys):
    """They were silently ignored (e.g. --default-budget for PCCoT)."""
    from latentserve.cli import main

    out = tmp_path / "out"
    assert main(["convert", family, "--base", str(tmp_path), "--out", str(out), *flag]) == 2
    assert f"convert {family} does not take {flag[0]}" in capsys.readouterr().err
    assert not out.exists()
