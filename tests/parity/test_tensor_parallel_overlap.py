"""Overlap scheduling under tensor parallelism on the CPU (issue 27; gloo, this process is rank
0, one worker subprocess rank 1): rank 0 broadcasts the previous step's sampled tokens with
the next batch and the worker substitutes the same pending ids (``engine/tp_worker.py``).
The overlapped TP=2 engine gives what the synchronous TP=2 engine and the TP=1 engine give,
output for output (tokens, finish reasons, latent step counts and stats, streamed latent
steps, recurrence stats and traces) with every sampled step's logits within 1e-4, for a plain
model (also with logprobs and penalties), COCONUT (feedback latents), a
closed-loop compression head (provisional steps undone a step later), Huginn and Ouro (mixed
depths, exit rules) and LOTUS (looped-block passes): greedy and seeded, stop ids, chunked
prefill, preemption, aborts in the latent phase and the answer, and a forward that raises
with a batch in flight; no KV slot leaks."""

import dataclasses

import pytest

from latentserve.config import EngineConfig
from latentserve.engine import overlap
from latentserve.engine.llm_engine import LLMEngine
from latentserve.sampling_params import SamplingParams
from tests.support.parity import shared_prefix_prompts
from tests.support.recurrent_requests import mixed_recurrent_requests
from tests.support.tp_parity import (
    abort_in_phase_and_answer,
    assert_same_streams,
    fail_forward_after_preemption,
    mixed_feedback_requests,
    mixed_head_requests,
    run_requests,
    run_streams,
    spy_overlapped,
)

# In this order consecutive tests share a TP=2 engine (``tp2``): the logprobs test
# (before) plain's, the aborts test (after) head's.
FAMILIES = ("plain", "huginn", "ouro", "lotus", "coconut", "head")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_dirs):
    """``family -> checkpoint dir``, each written on first use."""
    root, made = tmp_path_factory.mktemp("tp-overlap"), {"plain": tiny_dirs["llama"]}

    def get(family):
        if family not in made:
            from latentserve.bench.baseline.latent_models import save_latent_tiny
            from latentserve.bench.baseline.recurrent_models import write_huginn, write_ouro
            from tests.support.head_models import save_head_model
            from tests.support.loop_models import save_loop_tiny

            d = root / family
            made[family] = {
                "coconut": lambda: save_latent_tiny(d, "coconut-gpt2"),
                # a stop that fires now and then: provisional latent steps get undone
                "head": lambda: save_head_model(d, source_layer=1, stop_bias=0.3),
                # 3 heads: rank 0 takes 2, rank 1 one
                "huginn": lambda: write_huginn(d, n_embd=48, num_attention_heads=3,
                                               num_key_value_heads=3),
                "ouro": lambda: write_ouro(d),
                "lotus": lambda: save_loop_tiny(d, "lotus-llama", block_size=6, iterations=2),
            }[family]()
        return made[family]

    return get


def _engine(path, tp: int, overlapped: bool, **kw):
    kw = {"kv_slots": 4096, "max_model_len": 256, **kw}
    return LLMEngine(EngineConfig(model=str(path), tensor_parallel_size=tp,
                                  overlap_schedule=overlapped, **kw))


@pytest.fixture(scope="module")
def tp2(dirs):
    """``(family, **opts) -> an overlapped TP=2 engine`` (``_engine``), idle, with an empty
    prefix cache and no spies, as a fresh one. Starting one (a gloo worker subprocess) takes
    seconds and the process holds one group at a time: consecutive calls with the same
    family and options get the same engine; any other call shuts it down first."""
    held: dict = {}

    def get(family, **opts):
        key, engine = (family, sorted(opts.items())), held.get("engine")
        if engine is not None and (held["key"] != key or engine.has_unfinished_requests()):
            held.pop("engine").shutdown()
            engine = None
        if engine is None:
            engine = held["engine"] = _engine(dirs(family), 2, True, **opts)
            held["key"] = key
        engine.runner.__dict__.pop("run", None)  # an earlier test's spy
        engine.cache.radix.evict(engine.cache.radix.total_size())
        assert engine.cache.num_free == engine.num_kv_slots
        return engine

    yield get
    if "engine" in held:
        held["engine"].shutdown()


def _requests(family) -> list:
    """Mixed greedy and seeded requests for ``family``; no latent traces where tensor
    parallelism refuses them (feedback and head families)."""
    if family == "plain":
        kinds = [{"temperature": 0.0, "max_tokens": 9},
                 {"temperature": 0.8, "seed": 7, "max_tokens": 14},
                 {"temperature": 1.0, "top_k": 5, "seed": 3, "max_tokens": 11},
                 {"temperature": 0.7, "top_p": 0.9, "seed": 11, "max_tokens": 8},
                 {"temperature": 0.0, "max_tokens": 1}]
        return [(p, SamplingParams(ignore_eos=True, **kinds[i % len(kinds)]))
                for i, p in enumerate(shared_prefix_prompts())]
    if family in ("coconut", "lotus"):
        return mixed_feedback_requests(return_latent_trace=False)
    if family == "head":
        return mixed_head_requests(return_latent_trace=False)
    return mixed_recurrent_requests(family)


def test_tp_logprobs_and_penalties_overlap_and_equal_tp1(dirs, tp2):
    """Logprobs and penalties (the pending token counted on rank 0's device) keep a TP=2
    engine overlapped and give the synchronous TP=1 engine's outputs (prompt logprobs are
    refused under tensor parallelism)."""
    from tests.parity.test_overlap_scored import SCORED
    from tests.support.overlap_runs import assert_same_scored, scored_outputs

    scored = [{k: v for k, v in s.items() if k != "prompt_logprobs"} for s in SCORED]
    requests = [(p, dataclasses.replace(sp, **scored[i % len(scored)]))
                for i, (p, sp) in enumerate(_requests("plain"))]
    want = scored_outputs(_engine(dirs("plain"), 1, False), requests)
    over = tp2("plain")
    overlapped = spy_overlapped(over)
    assert overlap.eligible(over)
    assert_same_scored(scored_outputs(over, requests), want)
    assert sum(overlapped) > 5


@pytest.mark.parametrize("family", FAMILIES)
def test_overlapped_tp2_equals_synchronous_tp2_and_tp1(dirs, tp2, family):
    path, requests = dirs(family), _requests(family)
    one = _engine(path, 1, False)
    want = run_streams(one, requests)
    finals = [f for _, _, f in want[0]]
    if family == "coconut":
        assert [f.latent_steps for f in finals[:4]] == [3, 0, 6, 1]
    elif family == "head":  # fired stops (their provisional steps undone) and caps
        assert {"stop", "cap"} <= {f.latent_stats["end"] for f in finals}
    elif family == "lotus":  # passes over the block, their inputs computed at launch
        assert any(f.latent_steps for f in finals)
    elif family != "plain":
        assert all(f.recurrence for f in finals)
    over = tp2(family)
    overlapped = spy_overlapped(over)
    # The synchronous TP=2 engine: the same engine and worker stepping without overlap (the
    # option is read at each step), then emptied to a cold prefix cache.
    config = over.config
    over.config = dataclasses.replace(config, overlap_schedule=False)
    try:
        assert_same_streams(want, run_streams(over, requests))
    finally:
        over.config = config
    assert not any(overlapped)
    over.cache.radix.evict(over.cache.radix.total_size())
    overlapped.clear()
    got = run_streams(over, requests)  # run_requests checks that no KV slot leaked
    assert_same_streams(want, got)
    assert sum(overlapped) > 5  # the worker read rank 0's previous tokens
    # A stop id each request meets (its own second token, the first answer token of a
    # latent request): it finishes on a token of a batch it was launched past.
    stopped = [(p, dataclasses.replace(sp, stop_token_ids=[t[1]], ignore_eos=False))
               for (p, sp), (t, _, _) in zip(requests, want[0]) if len(t) > 2]
    want = run_streams(one, stopped)
    assert any(f.finish_reason == "stop" for _, _, f in want[0])
    assert_same_streams(want, run_streams(over, stopped))  # a warm prefix cache
    over.cache.radix.evict(over.cache.radix.total_size())
    assert over.cache.num_free == over.num_kv_slots  # every slot back in the pool


@pytest.mark.parametrize("family", ["head", "coconut"])
def test_aborts_in_the_latent_phase_and_the_answer_free_their_slots(dirs, tp2, family):
    """Requests aborted while a batch holding their rows is on the device (one in its
    latent phase, one in its answer) end with "abort"; the others give the TP=1 engine's
    greedy tokens."""
    path, prompts = dirs(family), shared_prefix_prompts()[:4]
    if family == "coconut":
        sp = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8, latent_budget=b)
              for b in (6, 1, 2, 3)]
    else:
        sp = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=14, max_latent=m,
                             min_output_tokens=0, use_stop=False) for m in (8, 1, 2, 3)]
    over = tp2(family)
    toks, finals = abort_in_phase_and_answer(over, list(zip(prompts, sp)),
                                             3 if family == "coconut" else 5)
    over.cache.check_idle()
    assert finals["a0"].finish_reason == finals["a1"].finish_reason == "abort"
    want = run_requests(_engine(path, 1, False), [(prompts[i], sp[i]) for i in (2, 3)])
    assert [toks["a2"], toks["a3"]] == [t for t, _, _ in want]


@pytest.mark.parametrize("family", ["plain", "head"])
@pytest.mark.parametrize("opts", [{"max_num_batched_tokens": 7}, {"kv_slots": 200}],
                         ids=["chunked-prefill", "preemption"])
def test_chunked_prefill_and_preemption_equal_tp1(dirs, tp2, family, opts):
    path, requests = dirs(family), _requests(family)
    want = run_streams(_engine(path, 1, False, **opts), requests)
    over = tp2(family, **opts)
    assert_same_streams(want, run_streams(over, requests))
    if "kv_slots" in opts:  # 8 prompts of up to 73 tokens + outputs in 200 slots
        assert over.scheduler.num_preemptions > 0


def test_failed_forward_keeps_the_batch_in_flight(dirs, tp2):
    """A forward that raises on rank 0 (before it sent the batch) keeps the batch in flight:
    its tokens, restored from their host copy, are what the next batch sends the worker;
    the waiting request goes on as with the synchronous TP=1 engine."""
    want = fail_forward_after_preemption(_engine(dirs("plain"), 1, False, kv_slots=16))
    got = fail_forward_after_preemption(tp2("plain", kv_slots=16))
    assert got[1] == want[1] == {"a": "abort", "b": "length"}
    assert got[0]["b"] == want[0]["b"] and len(got[0]["b"]) == 10
