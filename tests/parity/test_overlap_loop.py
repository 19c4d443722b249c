"""Overlap scheduling for looped-block models (issue 27): PCCoT and LOTUS under the overlap
scheduler give what the synchronous engine gives, output for output (tokens, finish
reasons, latent step counts, streamed latent steps and traces) with every sampled step's
logits within 1e-4: greedy and seeded, 0 to 6 passes in one batch, block sizes 1 to 6, stop
ids, chunked prefill, preemption, a warm prefix cache and aborts, with every KV slot back in
the pool afterwards; a pass's next inputs are computed on the device and passes move on by
counts."""

import dataclasses

import pytest

from latentserve.config import EngineConfig
from latentserve.engine import overlap
from latentserve.engine.llm_engine import LLMEngine
from latentserve.sampling_params import SamplingParams
from tests.support.loop_models import save_loop_tiny
from tests.support.parity import shared_prefix_prompts
from tests.support.tp_parity import (
    abort_in_phase_and_answer,
    assert_same_streams,
    mixed_feedback_requests,
    run_requests,
    run_streams,
    spy_overlapped,
)

# kind -> block size
KINDS = {"pccot-gpt2": 4, "lotus-llama": 6, "lotus-llama-b1": 1}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, smollm2_dir):
    pytest.importorskip("peft")  # PCCoT's adapter
    root = tmp_path_factory.mktemp("overlap-loop")
    return {k: save_loop_tiny(root / k, k.removesuffix("-b1"), block_size=n, iterations=2)
            for k, n in KINDS.items()}


def _engine(path, overlapped: bool, **kw):
    kw = {"kv_slots": 4096, "max_model_len": 256, **kw}
    return LLMEngine(EngineConfig(model=str(path), overlap_schedule=overlapped, **kw))


def _all_slots_free(engine) -> None:
    """Every KV slot is back in the free list once the radix cache lets its entries go."""
    cache = engine.cache
    cache.radix.evict(cache.radix.total_size())
    assert cache.num_free == engine.num_kv_slots == cache.allocator.num_total


@pytest.mark.parametrize("kind", list(KINDS))
def test_overlapped_loop_engine_equals_the_synchronous_one(dirs, kind):
    requests = mixed_feedback_requests()
    want = run_streams(_engine(dirs[kind], False), requests)
    engine = _engine(dirs[kind], True)
    overlapped = spy_overlapped(engine)
    got = run_streams(engine, requests)  # run_requests checks that no KV slot leaked
    assert_same_streams(want, got)
    _all_slots_free(engine)
    assert sum(overlapped) > 5
    n = KINDS[kind]
    assert [f.latent_steps for _, _, f in want[0][:4]] == [n * 4, n, n * 7, n * 2]
    assert any(len(s) > len(t) + 1 for s, (t, _, _) in zip(want[1], want[0]))  # ticks
    stopped = [(p, dataclasses.replace(sp, stop_token_ids=[t[2]], ignore_eos=False))
               for (p, sp), (t, _, _) in zip(requests, want[0])]
    want = run_streams(_engine(dirs[kind], False), stopped)
    assert_same_streams(want, run_streams(_engine(dirs[kind], True), stopped))
    assert any(f.finish_reason == "stop" for _, _, f in want[0])


@pytest.mark.parametrize("opts", [{"max_num_batched_tokens": 7}, {"kv_slots": 200}],
                         ids=["chunked-prefill", "preemption"])
def test_chunked_prefill_and_preemption_equal_the_synchronous_engine(dirs, opts):
    path, requests = dirs["lotus-llama"], mixed_feedback_requests()
    want = run_streams(_engine(path, False, **opts), requests)
    engine = _engine(path, True, **opts)
    assert_same_streams(want, run_streams(engine, requests))
    _all_slots_free(engine)
    if "kv_slots" in opts:
        assert engine.scheduler.num_preemptions > 0


def test_warm_prefix_cache_equals_the_synchronous_engine(dirs):
    path, requests = dirs["pccot-gpt2"], mixed_feedback_requests()
    sync = _engine(path, False)
    want = run_streams(sync, requests)
    engine = _engine(path, True)
    assert_same_streams(want, run_streams(engine, requests))
    assert engine.cache.radix.total_size() == sync.cache.radix.total_size()
    warm = run_streams(engine, requests)
    assert_same_streams(want, warm)
    assert all(f.num_cached_tokens > 0 for _, _, f in warm[0])


def test_aborts_in_a_pass_and_the_answer_free_their_slots(dirs):
    path = dirs["lotus-llama"]
    prompts = shared_prefix_prompts()[:4]
    sp = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8, latent_budget=b)
          for b in (6, 0, 2, 3)]
    engine = _engine(path, True)
    toks, finals = abort_in_phase_and_answer(engine, list(zip(prompts, sp)), 4)
    _all_slots_free(engine)
    assert finals["a0"].finish_reason == finals["a1"].finish_reason == "abort"
    want = run_requests(_engine(path, False), [(prompts[i], sp[i]) for i in (2, 3)])
    assert [toks["a2"], toks["a3"]] == [t for t, _, _ in want]


def test_loop_models_are_eligible(dirs):
    engine = _engine(dirs["lotus-llama"], True)
    engine.add_request("l", [5, 6, 7], SamplingParams(max_tokens=3, latent_budget=2))
    assert overlap.eligible(engine)
