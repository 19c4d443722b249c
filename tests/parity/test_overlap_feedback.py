"""Overlap scheduling for feedback-latent models (issue 27: every family on the fast path):
COCONUT and CODI under the overlap scheduler give what the synchronous engine gives, output
for output (tokens, finish reasons, latent step counts, streamed latent steps and traces)
with every sampled step's logits within 1e-4: greedy and seeded, latent budgets 0 to 6 in
one batch, stop tokens, chunked prefill, preemption, a warm prefix cache and aborts, with
no KV slot leaks; latent steps read the previous forward's hidden rows on the device."""

import dataclasses

import pytest

from latentserve.bench.baseline.latent_models import save_latent_tiny
from latentserve.config import EngineConfig
from latentserve.engine import overlap
from latentserve.engine.llm_engine import LLMEngine
from latentserve.sampling_params import SamplingParams
from tests.support.parity import shared_prefix_prompts
from tests.support.tp_parity import (
    abort_in_phase_and_answer,
    assert_same_streams,
    mixed_feedback_requests,
    run_requests,
    run_streams,
    spy_overlapped,
)

# codi-gpt2 keeps the eos: two start and two end ids
KINDS = {"coconut-gpt2": {}, "codi-llama": {}, "codi-gpt2": {"remove_eos": False}}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("overlap-feedback")
    return {k: save_latent_tiny(root / k, k, **opts) for k, opts in KINDS.items()}


def _engine(path, overlapped: bool, **kw):
    kw = {"kv_slots": 4096, "max_model_len": 256, **kw}
    return LLMEngine(EngineConfig(model=str(path), overlap_schedule=overlapped, **kw))


@pytest.mark.parametrize("kind", list(KINDS))
def test_overlapped_feedback_engine_equals_the_synchronous_one(dirs, kind):
    requests = mixed_feedback_requests()
    want = run_streams(_engine(dirs[kind], False), requests)
    engine = _engine(dirs[kind], True)
    overlapped = spy_overlapped(engine)
    got = run_streams(engine, requests)  # run_requests checks that no KV slot leaked
    assert_same_streams(want, got)
    assert sum(overlapped) > 5  # answer tokens read the previous forward's tokens
    finals = [f for _, _, f in want[0]]
    assert [f.latent_steps for f in finals[:4]] == [3, 0, 6, 1]
    assert any(len(s) > len(t) + 1 for s, (t, _, _) in zip(want[1], want[0]))  # ticks
    # A stop id each request meets (its own third answer token): it finishes on a token of
    # a batch it was already launched past, whose row is discarded.
    stopped = [(p, dataclasses.replace(sp, stop_token_ids=[t[2]], ignore_eos=False))
               for (p, sp), (t, _, _) in zip(requests, want[0])]
    want = run_streams(_engine(dirs[kind], False), stopped)
    assert_same_streams(want, run_streams(_engine(dirs[kind], True), stopped))
    assert any(f.finish_reason == "stop" for _, _, f in want[0])


@pytest.mark.parametrize("opts", [{"max_num_batched_tokens": 7}, {"kv_slots": 200}],
                         ids=["chunked-prefill", "preemption"])
def test_chunked_prefill_and_preemption_equal_the_synchronous_engine(dirs, opts):
    path, requests = dirs["codi-llama"], mixed_feedback_requests()
    want = run_streams(_engine(path, False, **opts), requests)
    engine = _engine(path, True, **opts)
    assert_same_streams(want, run_streams(engine, requests))
    if "kv_slots" in opts:  # 8 prompts of up to 73 tokens + latents + answers in 200 slots
        assert engine.scheduler.num_preemptions > 0


def test_warm_prefix_cache_equals_the_synchronous_engine(dirs):
    path, requests = dirs["coconut-gpt2"], mixed_feedback_requests()
    want = run_streams(_engine(path, False), requests)
    engine = _engine(path, True)
    assert_same_streams(want, run_streams(engine, requests))
    warm = run_streams(engine, requests)  # every prompt (and start id) is in the radix cache
    assert_same_streams(want, warm)
    assert all(f.num_cached_tokens > 0 for _, _, f in warm[0])


def test_aborts_in_the_latent_phase_and_the_answer_free_their_slots(dirs):
    """Requests aborted while a batch holding their rows is on the device (one in its
    latent phase, one in its answer) end with "abort"; the others give the synchronous
    engine's greedy tokens."""
    path = dirs["codi-llama"]
    prompts = shared_prefix_prompts()[:4]
    sp = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8, latent_budget=b)
          for b in (6, 1, 2, 3)]
    engine = _engine(path, True)
    toks, finals = abort_in_phase_and_answer(engine, list(zip(prompts, sp)), 3)
    engine.cache.check_idle()
    assert finals["a0"].finish_reason == finals["a1"].finish_reason == "abort"
    want = run_requests(_engine(path, False), [(prompts[i], sp[i]) for i in (2, 3)])
    assert [toks["a2"], toks["a3"]] == [t for t, _, _ in want]


def test_feedback_models_are_eligible(dirs):
    engine = _engine(dirs["coconut-gpt2"], True)
    engine.add_request("c", [5, 6, 7], SamplingParams(max_tokens=3, latent_budget=2))
    assert overlap.eligible(engine)
    engine.add_request("lp", [5, 6], SamplingParams(max_tokens=3, logprobs=1))
    assert overlap.eligible(engine)  # logprobs overlap (test_overlap_scored)
