"""Feedback latent models (COCONUT, CODI; SIM-CoT loads the same way): the engine's greedy
answers and first-answer logits equal the eager per-request reference loop over HF
transformers modules (``latentserve.bench.baseline.latent_reference``) for budgets 0, 1, 3, 6, 8 in
mixed-budget batches, with the prefix cache cold and warm. Latent positions are never served
from the radix cache."""

import pytest
import torch

from latentserve.bench.baseline.latent_models import LATENT_KINDS, save_latent_tiny
from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from tests.support.latent_reference import reference_generate
from tests.support.parity import run_budget_batch, shared_prefix_prompts

BUDGETS = (0, 1, 3, 6, 8)
MAX_TOKENS = 10


def _requests():
    """11 (prompt, budget) pairs: every budget, shared prefixes, and one prompt three times
    with different budgets (its latent KV must not be shared)."""
    prompts = shared_prefix_prompts()
    reqs = [(p, BUDGETS[i % len(BUDGETS)]) for i, p in enumerate(prompts)]
    return reqs + [(prompts[0], b) for b in (0, 6, 8)]


@pytest.fixture(scope="module")
def latent_dirs(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("latent-parity")
    return {k: save_latent_tiny(root / k, k) for k in LATENT_KINDS}


@pytest.fixture(scope="module")
def references(latent_dirs):
    return {k: [reference_generate(latent_dirs[k], p, b, MAX_TOKENS) for p, b in _requests()]
            for k in LATENT_KINDS}


def _run(engine, reqs, join_after: int | None = None):
    return run_budget_batch(engine, reqs, MAX_TOKENS, join_after)


def _assert_matches(kind, results, refs):
    for i, ((toks, lg, _), (ref_toks, ref_lg), (_, b)) in enumerate(
            zip(results, refs, _requests())):
        assert toks == ref_toks, f"{kind} request {i} (budget {b}): engine {toks} != ref {ref_toks}"
        torch.testing.assert_close(lg, ref_lg, atol=1e-4, rtol=0,
                                   msg=f"{kind} request {i} (budget {b}) first-answer logits")


@pytest.mark.parametrize("kind", LATENT_KINDS)
def test_mixed_budget_batch_matches_reference_cold_then_warm(kind, latent_dirs, references):
    engine = LLMEngine(EngineConfig(model=str(latent_dirs[kind])))
    spec = engine.latent_spec
    assert spec is not None and spec.family == kind.split("-")[0]
    results = _run(engine, _requests())
    _assert_matches(kind, results, references[kind])
    engine.cache.check_idle()

    results = _run(engine, _requests())  # warm: every prompt is in the radix cache
    _assert_matches(kind, results, references[kind])
    engine.cache.check_idle()
    for (_, _, cached), (prompt, _) in zip(results, _requests()):
        assert cached > 0, "warm run should hit the cache"
        # Only prompt (+ start) tokens are shareable: latent positions never are.
        assert cached <= len(prompt) + len(spec.start_ids)


@pytest.mark.parametrize("kind", ["coconut-gpt2", "codi-llama"])
def test_requests_joining_mid_flight_match_reference(kind, latent_dirs, references):
    engine = LLMEngine(EngineConfig(model=str(latent_dirs[kind])))
    _assert_matches(kind, _run(engine, _requests(), join_after=4), references[kind])
    engine.cache.check_idle()


@pytest.mark.parametrize("kind", ["coconut-gpt2", "codi-llama"])
def test_overlapped_mixed_budget_batch_matches_reference(kind, latent_dirs, references):
    """Under the overlap scheduler (the CUDA default) a step returns the previous forward's
    tokens: the first-answer logits are still the reference's (``run_budget_batch`` matches
    rows by output count, not by step)."""
    from tests.support.tp_parity import spy_overlapped

    engine = LLMEngine(EngineConfig(model=str(latent_dirs[kind]), overlap_schedule=True))
    overlapped = spy_overlapped(engine)
    _assert_matches(kind, _run(engine, _requests()), references[kind])
    assert sum(overlapped) > 5
    engine.cache.check_idle()


def test_same_prompt_different_budgets_do_not_share_latent_kv(latent_dirs):
    """Sequentially: a budget-8 request fills the cache, then the same prompt with budget 3
    and 0 must recompute from the first latent position on."""
    d = latent_dirs["codi-gpt2"]
    engine = LLMEngine(EngineConfig(model=str(d)))
    prompt = shared_prefix_prompts()[3]
    for b in (8, 3, 0, 8):
        (toks, lg, cached), = _run(engine, [(prompt, b)])
        ref_toks, ref_lg = reference_generate(d, prompt, b, MAX_TOKENS)
        assert toks == ref_toks, f"budget {b}"
        torch.testing.assert_close(lg, ref_lg, atol=1e-4, rtol=0)
        assert cached <= len(prompt) + len(engine.latent_spec.start_ids)
    engine.cache.check_idle()


def test_chunked_prefill_without_prefix_cache_matches_reference(latent_dirs, references):
    engine = LLMEngine(EngineConfig(model=str(latent_dirs["coconut-llama"]),
                                    max_num_batched_tokens=7, enable_prefix_caching=False))
    _assert_matches("coconut-llama", _run(engine, _requests()), references["coconut-llama"])
    assert engine.cache.num_free == engine.num_kv_slots


def test_codi_never_samples_eot(latent_dirs):
    """Upstream CODI takes the answer argmax over logits[:vocab - 1], so eot is never an
    answer token: even when eot's logit is made the largest, answers are unchanged."""
    engine = LLMEngine(EngineConfig(model=str(latent_dirs["codi-gpt2"])))
    eot = engine.latent_spec.end_ids[0]
    reqs = _requests()[:4]
    plain = [r[0] for r in _run(engine, reqs)]
    model = engine.runner.model
    original = model.compute_logits

    def eot_first(hidden):
        logits = original(hidden)
        logits[:, eot] = logits.max() + 100.0
        return logits

    model.compute_logits = eot_first
    boosted = [r[0] for r in _run(engine, reqs)]
    assert boosted == plain
    assert all(eot not in answer for answer in boosted)
    engine.cache.check_idle()


def test_thinking_off_runs_no_latent_steps_and_refuses_a_budget(latent_dirs):
    """``thinking=False`` on a feedback model is ``latent_budget=0`` (the same answer, no
    latent step); with a budget above 0 as well it is a ValueError naming both."""
    from latentserve import LLM, SamplingParams

    llm = LLM(model=str(latent_dirs["coconut-llama"]))
    prompt = {"prompt_token_ids": shared_prefix_prompts()[1]}
    off, zero, default = (
        llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, **kw))[0].outputs[0]
        for kw in ({"thinking": False}, {"latent_budget": 0}, {}))
    assert off.token_ids == zero.token_ids and off.latent_steps == zero.latent_steps == 0
    assert default.latent_steps == llm.engine.latent_spec.default_budget > 0
    with pytest.raises(ValueError, match="thinking is false but latent_budget is 3"):
        llm.generate([prompt], SamplingParams(thinking=False, latent_budget=3))
    llm.engine.cache.check_idle()
