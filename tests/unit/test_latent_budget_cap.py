"""The server's cap on ``latent_budget`` (``EngineConfig.max_latent_budget``,
``latentserve serve --max-latent-budget`` / ``--max-recurrence``)."""

import pytest

from latentserve.config import EngineConfig
from latentserve.latent.spec import LatentSpec, cap_budget

HUGINN = LatentSpec(kind="recurrent", family="huginn", default_budget=4, max_budget=8)
OURO = LatentSpec(kind="recurrent", family="ouro", default_budget=4, max_budget=6,
                  min_budget=1)


def test_cap_lowers_the_max_and_a_default_above_it():
    capped = cap_budget(HUGINN, 3)
    assert (capped.max_budget, capped.default_budget) == (3, 3)
    assert cap_budget(HUGINN, 6).default_budget == 4
    with pytest.raises(ValueError, match=r"latent_budget must be in \[0, 3\], got 4"):
        capped.resolve_budget(4)
    assert cap_budget(HUGINN, None) is HUGINN


@pytest.mark.parametrize("spec,cap,words", [
    (HUGINN, 9, r"max_latent_budget must be in \[1, 8\]"),
    (OURO, 7, r"max_latent_budget must be in \[1, 6\]"),
    (None, 4, "not a plain model"),
    (LatentSpec(kind="head", family="head", default_budget=0), 4,
     "looped-block and recurrent-depth models, not a compression head"),
])
def test_cap_outside_what_the_model_allows_is_refused_by_name(spec, cap, words):
    with pytest.raises(ValueError, match=words):
        cap_budget(spec, cap)


def test_engine_config_refuses_a_cap_below_one():
    with pytest.raises(ValueError, match="max_latent_budget must be >= 1, got 0"):
        EngineConfig(max_latent_budget=0)


@pytest.mark.parametrize("flag", ["--max-latent-budget", "--max-recurrence"])
def test_serve_flag_reaches_the_engine_config(flag):
    from latentserve.cli import build_parser, engine_config

    args = build_parser().parse_args(["serve", flag, "5"])
    assert engine_config(args).max_latent_budget == 5


def test_a_multi_model_server_applies_the_cap_where_it_can(tmp_path, tiny_dirs):
    """``serve --model A --model B --max-latent-budget N``: each latent model is capped within
    its own range, a plain model ignores the cap (one model alone still refuses it)."""
    import argparse

    from latentserve.bench.baseline.recurrent_models import write_ouro
    from latentserve.cli import add_engine_args, engine_configs
    from latentserve.engine.llm_engine import LLMEngine

    ouro = write_ouro(tmp_path / "ouro")  # max_recurrence 6
    p = argparse.ArgumentParser()
    add_engine_args(p, several_models=True)
    args = p.parse_args(["--model", str(tiny_dirs["llama"]), "--model", str(ouro),
                         "--max-latent-budget", "100"])
    plain_cfg, ouro_cfg = engine_configs(args)
    assert plain_cfg.latent_cap_where_applicable and ouro_cfg.latent_cap_where_applicable
    assert LLMEngine(plain_cfg).latent_spec is None
    assert LLMEngine(ouro_cfg).latent_spec.max_budget == 6
    with pytest.raises(ValueError, match="not a plain model"):
        LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), max_latent_budget=100))
    lowered = LLMEngine(EngineConfig(model=str(ouro), max_latent_budget=3,
                                     latent_cap_where_applicable=True)).latent_spec
    assert (lowered.max_budget, lowered.default_budget) == (3, 3)
