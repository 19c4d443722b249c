"""Regressions from a new user's pass over the recurrent-depth feature (Huginn, Ouro): each
invalid request is refused with a message that starts with the field the client actually
sent (the server's 400 reports that name as ``param``) and gives the model's allowed range."""

import types

import pytest

from latentserve.latent.recurrent import ExitRule, resolve_exit_rule
from latentserve.latent.spec import LatentSpec
from latentserve.sampling_params import SamplingParams
from latentserve.server.errors import APIError, param_from_value_error
from latentserve.server.latent_params import latent_budget

HUGINN = LatentSpec(kind="recurrent", family="huginn", default_budget=4, max_budget=8)
OURO = LatentSpec(kind="recurrent", family="ouro", default_budget=4, max_budget=6,
                  min_budget=1, default_exit=ExitRule("threshold", 1.0))


def _param(spec, **fields) -> str | None:
    with pytest.raises(ValueError) as exc:
        resolve_exit_rule(spec, SamplingParams(**fields))
    return param_from_value_error(str(exc.value))


@pytest.mark.parametrize(("spec", "fields", "param"), [
    # Huginn exit knobs without a criterion: the knob that was sent is named, not always
    # exit_threshold.
    (HUGINN, {"exit_min_steps": 2}, "exit_min_steps"),
    (HUGINN, {"exit_check_every": 3}, "exit_check_every"),
    (HUGINN, {"exit_threshold": 0.1}, "exit_threshold"),
    # Huginn 'none' runs no exit: a threshold or knob with it was silently ignored (Ouro's
    # 'last' with a threshold is refused).
    (HUGINN, {"exit_criterion": "none", "exit_threshold": 0.5}, "exit_threshold"),
    (HUGINN, {"exit_criterion": "none", "exit_min_steps": 1}, "exit_min_steps"),
    # Ouro: the Huginn knob that was sent; 'weighted' with a threshold names the threshold.
    (OURO, {"exit_check_every": 2}, "exit_check_every"),
    (OURO, {"exit_criterion": "threshold", "exit_min_steps": 1}, "exit_min_steps"),
    (OURO, {"exit_criterion": "weighted", "exit_threshold": 0.5}, "exit_threshold"),
    # Ouro thresholds are cumulative exit probabilities: above 1 was silently "last".
    (OURO, {"exit_criterion": "threshold", "exit_threshold": 5.0}, "exit_threshold"),
    (OURO, {"exit_criterion": "threshold-approx", "exit_threshold": 1.5}, "exit_threshold"),
    (OURO, {"exit_threshold": 2.0}, "exit_threshold"),
])
def test_exit_rule_errors_name_the_field_sent(spec, fields, param):
    assert _param(spec, **fields) == param


def test_ouro_threshold_range_is_in_the_message():
    with pytest.raises(ValueError, match=r"exit_threshold must be in \[0, 1\].*got 5.0"):
        resolve_exit_rule(OURO, SamplingParams(exit_criterion="threshold", exit_threshold=5.0))


def test_valid_rules_unchanged():
    assert resolve_exit_rule(HUGINN, SamplingParams(exit_criterion="none")) is None
    assert resolve_exit_rule(HUGINN, SamplingParams()) is None
    assert resolve_exit_rule(OURO, SamplingParams(exit_criterion="threshold",
                                                  exit_threshold=1.0)) == ExitRule("threshold",
                                                                                   1.0)
    assert resolve_exit_rule(OURO, SamplingParams(exit_criterion="threshold-approx",
                                                  exit_threshold=0.0)) == \
        ExitRule("threshold-approx", 0.0)
    assert resolve_exit_rule(OURO, SamplingParams()) == ExitRule("threshold", 1.0)


@pytest.mark.parametrize(("spec", "value", "message"), [
    # Ouro needs one loop step: "[0, 6]" named a value the engine then refuses.
    (OURO, 7, r"latent_budget must be in \[1, 6\], got 7"),
    (OURO, 0, r"latent_budget must be in \[1, 6\], got 0"),
    # A negative budget gets the model's range, not "[0, inf]".
    (OURO, -1, r"latent_budget must be in \[1, 6\], got -1"),
    (HUGINN, -3, r"latent_budget must be in \[0, 8\], got -3"),
    (HUGINN, 9, r"latent_budget must be in \[0, 8\], got 9"),
])
def test_http_budget_range_is_the_models(spec, value, message):
    req = types.SimpleNamespace(headers={})
    with pytest.raises(APIError, match=message) as exc:
        latent_budget(req, types.SimpleNamespace(latent_budget=value), spec)
    assert exc.value.param == "latent_budget"


def test_http_budget_in_range_passes():
    req = types.SimpleNamespace(headers={})
    assert latent_budget(req, types.SimpleNamespace(latent_budget=1), OURO) == 1
    assert latent_budget(req, types.SimpleNamespace(latent_budget=0), HUGINN) == 0
    assert latent_budget(req, types.SimpleNamespace(latent_budget=None), OURO) is None
    assert latent_budget(req, types.SimpleNamespace(latent_budget=0), None) == 0
    with pytest.raises(APIError, match=r"latent_budget must be 0 or null, got -1") as exc:
        latent_budget(req, types.SimpleNamespace(latent_budget=-1), None)  # a plain model
    assert exc.value.param == "latent_budget"


@pytest.mark.parametrize("family", ["huginn", "ouro"])
def test_cap_below_default_lowers_the_default(tmp_path, family):
    """docs/models.md: a ``max_latent_budget`` below the default depth lowers the default."""
    from latentserve.bench.baseline.recurrent_models import write_huginn, write_ouro
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine

    d = (write_huginn if family == "huginn" else write_ouro)(tmp_path / family)
    engine = LLMEngine(EngineConfig(model=str(d), kv_slots=256, max_model_len=64,
                                    max_latent_budget=2))
    assert engine.latent_spec.default_budget == engine.latent_spec.max_budget == 2
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2, temperature=0))
    assert engine.scheduler.waiting[-1].latent_budget == 2
    with pytest.raises(ValueError, match=r"latent_budget must be in \[\d, 2\], got 3"):
        engine.add_request("b", [5, 6, 7], SamplingParams(latent_budget=3))


@pytest.mark.parametrize("family,kw", [
    ("huginn", {"exit_criterion": "latent-diff", "exit_threshold": 0.3, "latent_budget": 8}),
    ("ouro", {"exit_criterion": "threshold-approx", "exit_threshold": 0.4, "latent_budget": 6}),
])
def test_follow_up_prompt_with_early_exit_matches_a_cold_engine(tmp_path, family, kw):
    """Generated tokens that exited early are not cached: a follow-up prompt that continues
    the answer (multi-turn chat) runs every iteration on it, as on a fresh engine."""
    from latentserve import LLM
    from latentserve.bench.baseline.recurrent_models import write_huginn, write_ouro

    path = (write_huginn if family == "huginn" else write_ouro)(tmp_path / family)
    prompt = [(13 * i + 3) % 900 + 20 for i in range(20)]

    def first_logits(llm, ids):
        runner, got = llm.engine.runner, []
        original = runner.run

        def recording(batch):
            out, hidden = original(batch)
            got.append(out[-1].float().clone())
            return out, hidden

        runner.run = recording
        try:
            llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, **kw),
                         use_tqdm=False)
        finally:
            runner.run = original
        return got[-1]

    warm = LLM(model=str(path))
    answer = warm.generate([prompt], SamplingParams(temperature=0, max_tokens=12,
                                                    ignore_eos=True, **kw), use_tqdm=False)
    follow_up = prompt + list(answer[0].outputs[0].token_ids)
    got = first_logits(warm, follow_up)
    want = first_logits(LLM(model=str(path)), follow_up)
    assert (got - want).abs().max().item() < 1e-4
    warm.engine.cache.check_idle()
