"""Loading Huginn / Ouro checkpoints in the upstream formats (config.json without a
transformers class, upstream weight names), KV bank layout, the recurrent LatentSpec, and
validation of per-request depth and exit fields."""

import builtins
import json

import pytest
import torch

from latentserve.bench.baseline.recurrent_models import write_huginn, write_ouro
from latentserve.config import EngineConfig
from latentserve.latent.load import load_model
from latentserve.latent.recurrent import ExitRule, cache_salt, resolve_exit_rule
from latentserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("recurrent_load")
    return {"huginn": write_huginn(root / "huginn"), "ouro": write_ouro(root / "ouro")}


def test_huginn_loads_with_upstream_names_and_bank_layout(dirs):
    model, cfg = load_model(dirs["huginn"], torch.float32, "cpu")
    assert type(model).__name__ == "RavenForCausalLM" and cfg.model_type == "huginn_raven"
    assert cfg.hidden_size == 64 and cfg.max_position_embeddings == 256
    # 1 prelude + T_max 8 x 2 core + 1 coda banks, 4 KV heads of 16.
    assert model.kv_shape == (1 + 8 * 2 + 1, 4, 16)
    assert [model.bank(t, l) for t in (0, 1, 7) for l in (0, 1)] == [1, 2, 3, 4, 15, 16]
    assert model.coda_bank(0) == 17
    assert model.lm_head.weight is model.transformer.wte.weight  # tied
    spec = model.latent_spec
    assert (spec.kind, spec.family, spec.default_budget, spec.max_budget) == \
        ("recurrent", "huginn", 4, 8)
    names = dict(model.named_parameters())
    for n in ("transformer.prelude.0.attn.Wqkv.weight", "transformer.core_block.1.attn.qk_bias",
              "transformer.coda.0.norm_4.weight", "transformer.adapter.weight",
              "transformer.ln_f.weight", "transformer.core_block.0.mlp.fc.weight"):
        assert n in names
    assert names["transformer.core_block.1.attn.qk_bias"].shape == (2, 1, 4, 16)
    # Initial states: trunc-normal, |x| <= 3 std * sqrt(n_embd), one fixed row per position.
    std = (2 / (5 * 64)) ** 0.5
    assert model.state_table.abs().max() <= 3 * std * 8 + 1e-6
    assert model.state_table.std() > 0.5 * std * 8


def test_huginn_init_scale_zero_gives_zero_states(tmp_path):
    d = write_huginn(tmp_path / "h", init_scale=0.0)
    model, _ = load_model(d, torch.float32, "cpu")
    assert not model.state_table.any()


def test_ouro_loads_with_hub_names_and_bank_layout(dirs):
    model, cfg = load_model(dirs["ouro"], torch.float32, "cpu")
    assert type(model).__name__ == "OuroForCausalLM" and cfg.model_type == "ouro"
    assert model.kv_shape == (6 * 2, 2, 16)  # T_max 6 x 2 layers, GQA 2 KV heads
    assert model.lm_head.weight is not model.model.embed_tokens.weight  # untied
    for n in ("model.layers.1.input_layernorm_2.weight",
              "model.layers.0.post_attention_layernorm_2.weight", "model.early_exit_gate.bias",
              "model.norm.weight", "lm_head.weight"):
        assert n in dict(model.named_parameters())
    spec = model.latent_spec
    assert (spec.family, spec.default_budget, spec.max_budget, spec.min_budget) == \
        ("ouro", 4, 6, 1)
    assert spec.default_exit == ExitRule("threshold", 1.0)


def test_ouro_early_exit_step_is_a_default_depth(tmp_path):
    d = write_ouro(tmp_path / "o", early_exit_step=1)
    model, _ = load_model(d, torch.float32, "cpu")
    assert model.latent_spec.default_budget == 2  # exit_at_step 1 == depth 2, last readout


def test_bad_weights_and_configs_are_rejected(dirs, tmp_path):
    from safetensors.torch import load_file, save_file

    for kind in ("huginn", "ouro"):
        d = tmp_path / kind
        d.mkdir()
        (d / "config.json").write_text((dirs[kind] / "config.json").read_text())
        sd = load_file(str(dirs[kind] / "model.safetensors"))
        extra = {**sd, "transformer.bogus.weight": torch.zeros(1)}
        save_file(extra, str(d / "model.safetensors"))
        with pytest.raises(KeyError, match="bogus"):
            load_model(d, torch.float32, "cpu")
        drop = "transformer.adapter.weight" if kind == "huginn" else "model.early_exit_gate.bias"
        save_file({k: v for k, v in sd.items() if k != drop}, str(d / "model.safetensors"))
        with pytest.raises(ValueError, match="missing"):
            load_model(d, torch.float32, "cpu")
    cfg = json.loads((dirs["ouro"] / "config.json").read_text())
    cfg["layer_types"] = ["sliding_attention", "full_attention"]
    d = tmp_path / "sliding"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="sliding"):
        load_model(d, torch.float32, "cpu")


def test_engine_never_asks_to_run_remote_code(dirs, monkeypatch):
    """Both configs carry an upstream ``auto_map``; nothing may prompt on stdin."""
    from latentserve.engine.llm_engine import LLMEngine

    def no_input(*a, **k):
        raise AssertionError("prompted for input")

    monkeypatch.setattr(builtins, "input", no_input)
    for d in dirs.values():
        engine = LLMEngine(EngineConfig(model=str(d), kv_slots=256, max_model_len=64))
        assert engine.eos_ids == {2}


def test_request_validation(dirs):
    from latentserve.engine.llm_engine import LLMEngine

    huginn = LLMEngine(EngineConfig(model=str(dirs["huginn"]), kv_slots=256, max_model_len=64))
    with pytest.raises(ValueError, match=r"latent_budget must be in \[0, 8\]"):
        huginn.add_request("a", [1, 2], SamplingParams(latent_budget=9))
    with pytest.raises(ValueError, match="exit_criterion must be one of"):
        huginn.add_request("b", [1, 2], SamplingParams(exit_criterion="weighted"))
    with pytest.raises(ValueError, match="need an exit_criterion"):
        huginn.add_request("c", [1, 2], SamplingParams(exit_threshold=0.1))
    with pytest.raises(ValueError, match="integer >= 1"):
        huginn.add_request("d", [1, 2], SamplingParams(exit_criterion="argmax-stability",
                                                       exit_threshold=1.5))
    huginn.add_request("ok", [1, 2], SamplingParams(exit_criterion="kl", latent_budget=0))
    req = huginn.scheduler.waiting[-1]
    assert req.state.exit_rule == ExitRule("kl", 1e-3) and req.latent_budget == 0
    assert req.prompt_ids == [1, 2] and req.answer_start == 0  # no phase machine
    assert req.cache_salt > 0 and req.cache_key[0] == (req.cache_salt << 32) + 1

    ouro = LLMEngine(EngineConfig(model=str(dirs["ouro"]), kv_slots=256, max_model_len=64))
    with pytest.raises(ValueError, match=r"latent_budget must be in \[1, 6\]"):
        ouro.add_request("a", [1, 2], SamplingParams(latent_budget=0))
    with pytest.raises(ValueError, match="Huginn options"):
        ouro.add_request("b", [1, 2], SamplingParams(exit_criterion="threshold",
                                                     exit_min_steps=1))
    with pytest.raises(ValueError, match="takes no exit_threshold"):
        ouro.add_request("c", [1, 2], SamplingParams(exit_criterion="weighted",
                                                     exit_threshold=0.5))
    spec = ouro.latent_spec
    assert resolve_exit_rule(spec, SamplingParams()) == ExitRule("threshold", 1.0)
    assert resolve_exit_rule(spec, SamplingParams(exit_threshold=0.3)) == \
        ExitRule("threshold", 0.3)
    assert resolve_exit_rule(spec, SamplingParams(exit_criterion="last")) is None
    # Exact readouts compute the same KV as "last"; only the approximate mode changes it.
    assert cache_salt(4, ExitRule("threshold", 0.3)) == cache_salt(4, None)
    assert cache_salt(4, ExitRule("threshold-approx", 0.3)) != cache_salt(4, None)


def test_plain_model_rejects_exit_fields(tmp_path):
    from latentserve.bench.baseline.tiny_models import save_tiny
    from latentserve.engine.llm_engine import LLMEngine

    d = save_tiny(tmp_path / "llama", "llama", word_tokenizer=True, vocab_size=1024)
    engine = LLMEngine(EngineConfig(model=str(d), kv_slots=256, max_model_len=64))
    with pytest.raises(ValueError, match="recurrent-depth model"):
        engine.add_request("a", [1, 2], SamplingParams(exit_criterion="kl"))


def test_sampling_params_exit_fields_are_validated():
    for kw, field in (({"exit_criterion": ""}, "exit_criterion"),
                      ({"exit_threshold": -0.1}, "exit_threshold"),
                      ({"exit_threshold": float("nan")}, "exit_threshold"),
                      ({"exit_min_steps": -1}, "exit_min_steps"),
                      ({"exit_check_every": 0}, "exit_check_every")):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**kw)


@pytest.mark.parametrize("field,value", [("exit_threshold", 0.5), ("exit_min_steps", 2),
                                         ("exit_check_every", 3)])
def test_plain_model_rejects_each_exit_field_by_name(tmp_path, field, value):
    from latentserve.bench.baseline.tiny_models import save_tiny
    from latentserve.engine.llm_engine import LLMEngine

    d = save_tiny(tmp_path / "llama", "llama", word_tokenizer=True, vocab_size=1024)
    engine = LLMEngine(EngineConfig(model=str(d), kv_slots=256, max_model_len=64))
    with pytest.raises(ValueError, match=f"^{field} needs a recurrent-depth model"):
        engine.add_request("a", [1, 2], SamplingParams(**{field: value}))
    engine.cache.check_idle()


@pytest.mark.parametrize("field", ["return_latent_trace", "stream_latent_steps"])
def test_latent_report_fields_on_a_plain_model_are_refused(tmp_path, field):
    """They would silently do nothing (trace null, no ticks)."""
    from latentserve.bench.baseline.tiny_models import save_tiny
    from latentserve.engine.llm_engine import LLMEngine

    d = save_tiny(tmp_path / "llama", "llama", word_tokenizer=True, vocab_size=1024)
    engine = LLMEngine(EngineConfig(model=str(d), kv_slots=256, max_model_len=64))
    with pytest.raises(ValueError, match=f"^{field} needs .* not a model without latent"):
        engine.add_request("a", [1, 2], SamplingParams(**{field: True}))
    engine.cache.check_idle()


def test_stream_latent_steps_on_a_recurrent_model_is_refused(tmp_path):
    from latentserve.bench.baseline.recurrent_models import write_huginn
    from latentserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(write_huginn(tmp_path / "h"))))
    with pytest.raises(ValueError, match="^stream_latent_steps needs .* recurrent-depth"):
        engine.add_request("a", [5, 6], SamplingParams(stream_latent_steps=True))
    engine.add_request("b", [5, 6], SamplingParams(max_tokens=1, return_latent_trace=True))
    while engine.has_unfinished_requests():
        engine.step()
    engine.cache.check_idle()
