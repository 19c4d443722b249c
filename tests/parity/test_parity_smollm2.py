"""Real weights: SmolLM2-135M-Instruct (the embedded GGUF, dequantized to fp32) gives HF
transformers' greedy tokens and prefill logits, cold and with the prefix cache warm."""

import pytest
import torch

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from tests.support.parity import chat_prompts, hf_reference, run_batch

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    return chat_prompts(smollm2_tokenizer)


@pytest.mark.slow
def test_smollm2_batch_matches_hf(smollm2_dir, prompts, hf_models):
    hf = hf_models(smollm2_dir)
    refs = [hf_reference(hf, p, MAX_TOKENS) for p in prompts]
    engine = LLMEngine(EngineConfig(model=str(smollm2_dir), max_model_len=1024))
    for run in ("cold", "warm"):
        tokens, logits, cached = run_batch(engine, prompts, MAX_TOKENS)
        for i, (toks, lg, (ref_toks, ref_lg)) in enumerate(zip(tokens, logits, refs)):
            assert toks == ref_toks, f"{run} prompt {i}"
            torch.testing.assert_close(lg, ref_lg, atol=1e-4, rtol=0, msg=f"{run} {i} logits")
        engine.cache.check_idle()
    # The chat template's system prompt is shared by all eight, so every warm prompt hits.
    assert min(cached) >= 20
