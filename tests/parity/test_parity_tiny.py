"""The engine's greedy tokens and prefill logits equal HF transformers' on tiny random
checkpoints of every supported architecture, cold and with the prefix cache warm."""

import pytest
import torch

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from tests.support.parity import hf_reference, run_batch, shared_prefix_prompts

KINDS = ["llama", "llama-untied", "qwen2", "gpt2"]
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def references(tiny_dirs, hf_models):
    prompts = shared_prefix_prompts()
    return {k: [hf_reference(hf_models(tiny_dirs[k]), p, MAX_TOKENS) for p in prompts]
            for k in KINDS}


def _assert_matches(tokens, logits, refs):
    for i, (toks, lg, (ref_toks, ref_lg)) in enumerate(zip(tokens, logits, refs)):
        assert toks == ref_toks, f"prompt {i}: engine {toks} != HF {ref_toks}"
        torch.testing.assert_close(lg, ref_lg, atol=1e-4, rtol=0, msg=f"prompt {i} logits")


@pytest.mark.parametrize("kind", KINDS)
def test_batch_matches_hf_cold_then_warm(kind, tiny_dirs, references):
    engine = LLMEngine(EngineConfig(model=str(tiny_dirs[kind])))
    prompts = shared_prefix_prompts()
    tokens, logits, cached = run_batch(engine, prompts, MAX_TOKENS)
    _assert_matches(tokens, logits, references[kind])
    engine.cache.check_idle()

    before = engine.runner.num_computed_tokens
    tokens, logits, cached = run_batch(engine, prompts, MAX_TOKENS)
    _assert_matches(tokens, logits, references[kind])
    assert all(c > 0 for c in cached), f"warm run should hit the cache for every prompt: {cached}"
    engine.cache.check_idle()
    # Warm: each prompt computes only its uncached suffix, plus one token per decode step.
    expected = sum(len(p) - c + len(t) - 1 for p, c, t in zip(prompts, cached, tokens))
    assert engine.runner.num_computed_tokens - before == expected


def test_chunked_prefill_matches_hf(tiny_dirs, references):
    engine = LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), max_num_batched_tokens=7,
                                    enable_prefix_caching=False))
    tokens, logits, _ = run_batch(engine, shared_prefix_prompts(), MAX_TOKENS)
    _assert_matches(tokens, logits, references["llama"])
    engine.cache.check_idle()


def test_preemption_when_slots_run_out_matches_hf(tiny_dirs, references):
    # 8 prompts of up to 73 tokens + 12 outputs each cannot all fit in 160 slots.
    engine = LLMEngine(EngineConfig(model=str(tiny_dirs["qwen2"]), kv_slots=160))
    tokens, logits, _ = run_batch(engine, shared_prefix_prompts(), MAX_TOKENS)
    assert engine.scheduler.num_preemptions > 0
    for i, (toks, (ref_toks, _)) in enumerate(zip(tokens, references["qwen2"])):
        assert toks == ref_toks, f"prompt {i}"
    engine.cache.check_idle()


def test_no_prefix_cache_leaves_every_slot_free(tiny_dirs):
    engine = LLMEngine(EngineConfig(model=str(tiny_dirs["gpt2"]), enable_prefix_caching=False))
    run_batch(engine, shared_prefix_prompts(), 4)
    assert engine.cache.num_free == engine.num_kv_slots
