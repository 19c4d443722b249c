"""The shipped CoLaR model (``models/smollm2-mult-colar``: LoRA over the embedded SmolLM2 and
a latent policy, trained by ``latentserve train colar``) served by the engine in float32
equals the eager reference (``tests.support.colar_reference``, upstream ``latent_generate`` with
greedy choices) on real test questions: one batch mixing thinking speeds and a latent cap,
cold and then warm prefix cache; answer tokens, latent steps, how the phase ended, and the
first answer token's logits within 1e-4. The answers are also checked against the gold
products the test file gives (what the model gets right is whatever it gets)."""

from pathlib import Path

import pytest
import torch

from latentserve.config import EngineConfig
from latentserve.latent import colar

MODEL = Path(__file__).parents[2] / "models" / "smollm2-mult-colar"
MAX_TOKENS = 20  # "Answer:" + 8 or 10 digits with spaces, then EOS

# (question, gold, c, max_latent): 4x4 at speed 2, 5x5 at 4, one cap that cuts in.
CASES = [("7 6 9 2 * 1 6 3 6", "7 8 0 3 7 8 8 1", 2, 160),
         ("9 4 0 8 3 * 1 4 2 0 1", "9 0 8 9 5 6 9 8 3 0", 4, 160),
         ("7 2 2 9 * 2 7 7 8", "4 4 2 9 3 9 0 8", 2, 20)]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not MODEL.is_dir(), reason="models/smollm2-mult-colar absent")]


@pytest.fixture(scope="module")
def references(smollm2_dir):
    from tests.support.colar_reference import (
        colar_generate_reference,
        load_colar_reference,
    )

    model, tok, cfg, policy = load_colar_reference(MODEL)
    return [colar_generate_reference(model, tok, policy, cfg, q, c, cap, MAX_TOKENS)
            for q, _, c, cap in CASES]


def test_engine_equals_reference_cold_then_warm(references):
    from latentserve.engine.llm_engine import LLMEngine
    from tests.support.colar_reference import run_colar_batch

    engine = LLMEngine(EngineConfig(model=str(MODEL), dtype="float32", max_model_len=512))
    sep = engine.tokenizer.convert_tokens_to_ids(colar.SEPARATOR)
    for tag in ("cold", "warm"):
        cases = [(q, c, cap) for q, _, c, cap in CASES]
        results = run_colar_batch(engine, cases, MAX_TOKENS)
        for i, ((toks, final, first), ref) in enumerate(zip(results, references)):
            msg = f"{tag} case {i} {CASES[i][2:]}"
            assert toks == ref.answer_ids, msg
            fired = ref.n_latent > 0 and int(ref.latent_logits[-1].argmax()) == sep
            assert final.latent_stats["steps"] == ref.n_latent, msg
            assert final.latent_stats["end"] == ("stop" if fired else "cap"), msg
            torch.testing.assert_close(first, ref.answer_logits[0], atol=1e-4, rtol=0, msg=msg)
            if tag == "warm":  # the prompt came from the radix cache
                assert 0 < final.num_cached_tokens <= len(ref.prompt_ids), msg
        engine.cache.check_idle()
    assert [r.n_latent for r in references][2] == 20  # the cap cut case 2's phase


def test_the_reference_answers_in_format_and_stops_at_the_trained_step(references,
                                                                          smollm2_tokenizer):
    """At speed 2 this 4x4 product (84 CoT tokens) is answered right after 42 latents; at
    speed 4 the 5x5 stop fires at ceil(137 / 4) = 35 and an answer of digits follows (a
    wrong one: speed 4 is not learnt, docs/results.md)."""
    answers = [colar.split_output(colar.SEPARATOR + smollm2_tokenizer.decode(
        r.answer_ids, skip_special_tokens=True))[1] for r in references]
    assert answers[0] == CASES[0][1], answers
    assert answers[1].replace(" ", "").isdigit(), answers
    assert [r.n_latent for r in references[:2]] == [42, 35]
