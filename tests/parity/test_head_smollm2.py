"""The shipped stage-2 head (``models/smollm2-mult-head``: the seed's compression head trained
by ``latentserve train-head`` sft, dagger and grpo over the frozen ``smollm2-mult-cot``
backbone) served by the engine in float32 equals the eager head reference
(``tests.support.head_reference``, over the backbone with its LoRA merged by PEFT) on real
4x4 and 5x5 test questions in CoLaR's prompt format: answer tokens, latent steps and how the
phase ended. The stop fires at ceil(text CoT tokens / 4), where DAgger trained it
(docs/results.md, "Stage 2"); the answers are wrong, as on the full test sets."""

from pathlib import Path

import pytest

from latentserve.config import EngineConfig
from latentserve.latent import colar

MODEL = Path(__file__).parents[2] / "models" / "smollm2-mult-head"
ANSWER_TOKENS = 12
MAX_TOKENS = 64 + 1 + ANSWER_TOKENS  # latent steps and the closing ### count too
# (question, text CoT tokens of stage 0 on it): 4x4, then 5x5
CASES = [("7 6 9 2 * 1 6 3 6", 84), ("9 4 0 8 3 * 1 4 2 0 1", 137)]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not MODEL.is_dir(), reason="models/smollm2-mult-head absent")]


@pytest.fixture(scope="module")
def merged_dir(tmp_path_factory, smollm2_dir):
    """The backbone as HF weights: the embedded SmolLM2 with the directory's LoRA merged."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, str(MODEL)).merge_and_unload()
    out = tmp_path_factory.mktemp("head_backbone")
    model.save_pretrained(out)
    return out


def test_engine_equals_reference_and_the_stop_fires_where_trained(merged_dir):
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.sampling_params import SamplingParams
    from tests.support.head_reference import head_reference_generate

    engine = LLMEngine(EngineConfig(model=str(MODEL), dtype="float32", max_model_len=512))
    spec = engine.latent_spec
    prompts = colar.prompt_ids(engine.tokenizer, [q for q, _ in CASES])
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                      min_output_tokens=0, max_latent=64))
    toks, stats = {f"r{i}": [] for i in range(len(prompts))}, {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            toks[o.rid] += o.new_token_ids
            if o.finished:
                stats[o.rid] = o.latent_stats
    bundle = MODEL / "latent_reasoning_head.safetensors"
    for i, (p, (q, cot_tokens)) in enumerate(zip(prompts, CASES)):
        ref = head_reference_generate(merged_dir, bundle, p, spec.start_ids, spec.end_ids,
                                      max_latent=64, max_tokens=MAX_TOKENS,
                                      eos_ids=engine.eos_ids)
        st = stats[f"r{i}"]
        assert st["end"] == ref["end"] == "stop", q
        assert st["steps"] == ref["steps"] == -(-cot_tokens // 4), q
        assert toks[f"r{i}"] == ref["tokens"], q
        assert len(ref["tokens"]) > ANSWER_TOKENS, q  # the phase left answer tokens to compare
        assert abs(st["max_stop_prob"] - ref["max_stop_prob"]) < 1e-5, q
    engine.cache.check_idle()
