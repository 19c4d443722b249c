"""Overlap scheduling for compression-head models (issue 27): a closed-loop latent step is
decided at launch and settled a step later (``latent/head_late.py``); a fired stop undoes the
provisional step and discards its row. The compression head (closed loop and prompt mode)
and CoLaR under the overlap scheduler give what the synchronous engine gives, output for
output (tokens, finish reasons, latent step counts and stats, streamed latent steps, traces)
with every sampled step's logits within 1e-4: greedy and seeded (latent temperature too),
mixed caps, ``min_latent``, thresholds, thinking off, the answer-budget floor, an output
budget spent in the latent phase, stop ids, chunked prefill, preemption, a warm prefix cache
and aborts, with every KV slot back in the pool afterwards."""

import dataclasses

import pytest

from latentserve.config import EngineConfig
from latentserve.engine import overlap
from latentserve.engine.llm_engine import LLMEngine
from latentserve.latent.head_loop import set_policy_sampling
from latentserve.sampling_params import SamplingParams
from tests.support.colar_models import save_colar_tiny
from tests.support.head_models import save_head_model
from tests.support.parity import shared_prefix_prompts
from tests.support.tp_parity import (
    abort_in_phase_and_answer,
    assert_same_streams,
    mixed_colar_requests,
    mixed_head_requests,
    run_requests,
    run_streams,
    spy_overlapped,
)

KINDS = ("closed_loop", "prompt", "colar")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, smollm2_dir):
    root = tmp_path_factory.mktemp("overlap-head")
    return {"closed_loop": save_head_model(root / "cl", source_layer=1, stop_bias=0.3),
            "prompt": save_head_model(root / "pr", injection="prompt", source_layer=0, seed=3),
            "colar": save_colar_tiny(root / "colar", stop_push=16.0)}


def _requests(kind, **over):
    return mixed_colar_requests(**over) if kind == "colar" else mixed_head_requests(**over)


def _engine(path, overlapped: bool, **kw):
    kw = {"kv_slots": 4096, "max_model_len": 256, **kw}
    return LLMEngine(EngineConfig(model=str(path), overlap_schedule=overlapped, **kw))


def _all_slots_free(engine) -> None:
    """Every KV slot is back in the free list once the radix cache lets its entries go."""
    cache = engine.cache
    cache.radix.evict(cache.radix.total_size())
    assert cache.num_free == engine.num_kv_slots == cache.allocator.num_total


@pytest.mark.parametrize("kind", KINDS)
def test_overlapped_head_engine_equals_the_synchronous_one(dirs, kind):
    requests = _requests(kind)
    want = run_streams(_engine(dirs[kind], False), requests)
    engine = _engine(dirs[kind], True)
    overlapped = spy_overlapped(engine)
    got = run_streams(engine, requests)  # run_requests checks that no KV slot leaked
    assert_same_streams(want, got)
    _all_slots_free(engine)
    assert sum(overlapped) > 5
    stats = [f.latent_stats for _, _, f in want[0]]
    ends = {s["end"] for s in stats}
    if kind == "closed_loop":  # stops fired and undid a provisional step; caps; budgets
        assert {"stop", "cap", "length"} <= ends and None in {s["stop_step"] for s in stats}
        assert sum(overlapped) < len(overlapped)  # not every step waited for nothing
    elif kind == "colar":
        assert {"stop", "cap"} <= ends
    if kind != "prompt":  # streamed latent steps (prompt mode has one, not streamed)
        assert any(len(s) > len(t) + 1 for s, (t, _, _) in zip(want[1], want[0]))
    # A stop id each request meets (its own second answer token): it finishes on a token of
    # a batch it was already launched past, whose row is discarded.
    stopped = [(p, dataclasses.replace(sp, stop_token_ids=[t[1]], ignore_eos=False))
               for (p, sp), (t, _, _) in zip(requests, want[0]) if len(t) > 1]
    want = run_streams(_engine(dirs[kind], False), stopped)
    assert_same_streams(want, run_streams(_engine(dirs[kind], True), stopped))
    assert any(f.finish_reason == "stop" for _, _, f in want[0])


def test_undone_steps_happen(dirs, monkeypatch):
    """The closed-loop batch undoes provisional latent steps (a stop fired after the host
    had moved its request on) and keeps others."""
    import latentserve.latent.head_loop as head_loop

    stood, settle = [], head_loop.settle

    def spy(*args):
        stood.append(settle(*args))
        return stood[-1]

    monkeypatch.setattr(head_loop, "settle", spy)
    run_requests(_engine(dirs["closed_loop"], True), mixed_head_requests())
    assert stood.count(False) >= 2 and stood.count(True) > 10


@pytest.mark.parametrize("kind", ["closed_loop", "colar"])
@pytest.mark.parametrize("opts", [{"max_num_batched_tokens": 7}, {"kv_slots": 200}],
                         ids=["chunked-prefill", "preemption"])
def test_chunked_prefill_and_preemption_equal_the_synchronous_engine(dirs, kind, opts):
    path, requests = dirs[kind], _requests(kind)
    want = run_streams(_engine(path, False, **opts), requests)
    engine = _engine(path, True, **opts)
    assert_same_streams(want, run_streams(engine, requests))
    _all_slots_free(engine)
    if "kv_slots" in opts:
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("kind", ["closed_loop", "colar"])
def test_warm_prefix_cache_equals_the_synchronous_engine(dirs, kind):
    path, requests = dirs[kind], _requests(kind)
    sync = _engine(path, False)
    want = run_streams(sync, requests)
    engine = _engine(path, True)
    assert_same_streams(want, run_streams(engine, requests))
    # the discarded rows' KV is not cached: the cache holds what the synchronous one holds
    assert engine.cache.radix.total_size() == sync.cache.radix.total_size()
    warm = run_streams(engine, requests)  # every prompt (and opening id) is in the cache
    assert_same_streams(want, warm)
    assert all(f.num_cached_tokens > 0 for _, _, f in warm[0])
    _all_slots_free(engine)


def test_aborts_in_the_latent_phase_and_the_answer_free_their_slots(dirs):
    """Requests aborted while a batch holding their rows is on the device (one in its
    latent phase, one in its answer) end with "abort"; the others give the synchronous
    engine's greedy tokens."""
    path = dirs["closed_loop"]
    prompts = shared_prefix_prompts()[:4]
    sp = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=14, min_output_tokens=0,
                         max_latent=m, use_stop=False) for m in (8, 1, 2, 3)]
    engine = _engine(path, True)
    toks, finals = abort_in_phase_and_answer(engine, list(zip(prompts, sp)), 5)
    engine.cache.check_idle()
    _all_slots_free(engine)
    assert finals["a0"].finish_reason == finals["a1"].finish_reason == "abort"
    want = run_requests(_engine(path, False), [(prompts[i], sp[i]) for i in (2, 3)])
    assert [toks["a2"], toks["a3"]] == [t for t, _, _ in want]


def test_head_models_are_eligible_but_not_under_policy_sampling(dirs):
    engine = _engine(dirs["closed_loop"], True)
    engine.add_request("h", [5, 6, 7], SamplingParams(max_tokens=3, max_latent=2,
                                                      min_output_tokens=0))
    assert overlap.eligible(engine)
    head = engine.runner.model.latent_head
    set_policy_sampling(head, 0.5)  # GRPO rollouts draw from the global RNG every step
    assert not overlap.eligible(engine)
    set_policy_sampling(head, None)
    assert overlap.eligible(engine)
    assert not _engine(dirs["closed_loop"], None).config.use_overlap_schedule  # CPU: opt-in
