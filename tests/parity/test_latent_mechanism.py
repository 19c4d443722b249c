"""The engine's feedback-latent mechanism (phase machine, injection after the embedding
lookup, radix exclusion) against an eager HF reference, on a plain tiny Llama given an
identity-feedback LatentSpec. Family checkpoints (COCONUT, CODI) are tested separately."""

import pytest

from latentserve.config import EngineConfig
from latentserve.sampling_params import SamplingParams
from tests.support.latent_mock import mock_latent_loading, mock_reference, run_mixed_budgets

PROMPTS = [[5 + i + j for j in range(10 + 3 * i)] for i in range(8)]
BUDGETS = [0, 1, 3, 6, 8, 0, 3, 6]


@pytest.fixture(scope="module")
def engine(tiny_dirs):
    from latentserve.engine.llm_engine import LLMEngine

    with mock_latent_loading():
        return LLMEngine(EngineConfig(model=str(tiny_dirs["llama"])))


def test_mixed_budgets_match_reference_cold_and_warm(engine, tiny_dirs, hf_models):
    hf = hf_models(tiny_dirs["llama"])
    refs = [mock_reference(hf, p, b, 8) for p, b in zip(PROMPTS, BUDGETS)]
    for run in ("cold", "warm"):
        answers, steps = run_mixed_budgets(engine, PROMPTS, BUDGETS, 8, tag=run)
        assert answers == refs, run
        assert steps == BUDGETS
        engine.cache.check_idle()


def test_radix_never_caches_latent_positions(engine):
    engine.cache.radix.reset()
    prompt = list(range(300, 340))
    run_mixed_budgets(engine, [prompt], [5], 4, tag="a")
    # Only the prompt and the start token are cached: nothing at or after the first latent.
    assert engine.cache.radix.total_size() == len(prompt) + 1
    before = engine.runner.num_computed_tokens
    answers, _ = run_mixed_budgets(engine, [prompt], [2], 4, tag="b")
    # The second request reuses prompt + start (all but the last token) and recomputes its
    # own latents: start position + 2 latents + end + (answer tokens - 1) decode steps.
    assert engine.runner.num_computed_tokens - before == 1 + 2 + 1 + len(answers[0]) - 1
    engine.cache.check_idle()


def test_budget_above_cap_is_rejected(engine):
    with pytest.raises(ValueError, match=r"latent_budget must be in \[0, 16\]"):
        engine.add_request("too-big", [1, 2, 3], SamplingParams(latent_budget=17))
    with pytest.raises(ValueError, match="latent_budget"):
        SamplingParams(latent_budget=-1)
    with pytest.raises(ValueError, match="latent_budget"):
        SamplingParams(latent_budget=2.5)
