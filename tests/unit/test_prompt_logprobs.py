"""Prompt logprobs (``SamplingParams.prompt_logprobs``) from the engine equal the
log-softmax of an HF reference forward over the same prompt, whether the prompt runs in one
chunk or several and whether the prefix cache already holds it."""

import pytest
import torch

from latentserve.config import EngineConfig
from latentserve.sampling_params import SamplingParams

PROMPT = [1, 2000, 3000, 4000, 17, 250, 9, 4000, 3000, 12, 5]


@pytest.fixture(scope="module")
def reference(tiny_dirs, hf_models):
    """``[len(PROMPT) - 1, vocab]`` reference log-softmax: row i scores PROMPT[i + 1]."""
    with torch.no_grad():
        logits = hf_models(tiny_dirs["llama"])(torch.tensor([PROMPT])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1)


def _run(engine, rid, params):
    engine.add_request(rid, PROMPT, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.rid == rid]
    return outs


def _check(outs, reference, k):
    carrying = [o for o in outs if o.prompt_logprobs is not None]
    assert len(carrying) == 1  # delivered exactly once
    lps = carrying[0].prompt_logprobs
    assert len(lps) == len(PROMPT) and lps[0] is None
    for p, lp in enumerate(lps[1:], start=1):
        row = reference[p - 1]
        assert lp.token_id == PROMPT[p]
        assert lp.logprob == pytest.approx(float(row[PROMPT[p]]), abs=1e-4)
        assert lp.rank == int((row > row[PROMPT[p]]).sum()) + 1
        top_v, top_i = row.topk(k)
        assert [t for t, _ in lp.top] == top_i.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=1e-4)


@pytest.mark.parametrize("chunk", [2048, 4])
def test_prompt_logprobs_match_the_reference(tiny_dirs, reference, chunk):
    from latentserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), kv_slots=512,
                                    max_num_batched_tokens=chunk))
    # A plain request first, so the prompt sits in the prefix cache.
    plain = _run(engine, "plain", SamplingParams(max_tokens=2, temperature=0))
    assert all(o.prompt_logprobs is None for o in plain)
    before = engine.runner.num_computed_tokens
    outs = _run(engine, "asks", SamplingParams(max_tokens=2, temperature=0,
                                               prompt_logprobs=3))
    # The whole prompt was computed again (no prefix-cache hit) and scored.
    assert engine.runner.num_computed_tokens - before >= len(PROMPT)
    _check(outs, reference, 3)
    assert not engine.prompt_logprobs  # nothing left tracked
    engine.cache.check_idle()


def test_aborted_request_leaves_nothing_tracked(tiny_dirs):
    from latentserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), kv_slots=512,
                                    max_num_batched_tokens=4))
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=4, prompt_logprobs=0))
    engine.step()  # the first 4-token chunk only
    engine.abort_request("r")
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()
    assert not engine.prompt_logprobs
    engine.cache.check_idle()


def test_negative_prompt_logprobs_is_refused_by_name():
    with pytest.raises(ValueError, match="prompt_logprobs must be >= 0, got -1"):
        SamplingParams(prompt_logprobs=-1)
