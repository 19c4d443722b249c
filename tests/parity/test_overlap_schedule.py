"""Overlap scheduling (``EngineConfig.overlap_schedule``, engine/overlap.py): the engine
prepares step k+1 before step k's tokens reach the host. Greedy tokens and first logits
equal HF transformers' (cold, warm prefix cache, chunked prefill, preemption); sampled,
stopped and aborted requests, logprobs, prompt logprobs and penalties give what the
synchronous engine gives; no KV slot leaks."""

import dataclasses

import pytest
import torch

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.sampling_params import SamplingParams
from tests.support.overlap_runs import assert_same_scored, scored_outputs
from tests.support.parity import hf_reference, run_batch, shared_prefix_prompts
from tests.support.tp_parity import fail_forward_after_preemption, run_requests, spy_overlapped

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def references(tiny_dirs, hf_models):
    model = hf_models(tiny_dirs["llama"])
    return [hf_reference(model, p, MAX_TOKENS) for p in shared_prefix_prompts()]


def _engine(tiny_dirs, **kw):
    return LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), overlap_schedule=True, **kw))


def _assert_matches(tokens, logits, refs):
    for i, (toks, lg, (ref_toks, ref_lg)) in enumerate(zip(tokens, logits, refs)):
        assert toks == ref_toks, f"prompt {i}: engine {toks} != HF {ref_toks}"
        torch.testing.assert_close(lg, ref_lg, atol=1e-4, rtol=0, msg=f"prompt {i} logits")


def test_greedy_matches_hf_cold_then_warm(tiny_dirs, references):
    engine = _engine(tiny_dirs)
    overlapped = spy_overlapped(engine)
    prompts = shared_prefix_prompts()
    tokens, logits, _ = run_batch(engine, prompts, MAX_TOKENS)
    _assert_matches(tokens, logits, references)
    engine.cache.check_idle()
    # Every forward after the first reads the previous forward's tokens on the device.
    assert not overlapped[0] and all(overlapped[1:]) and len(overlapped) > MAX_TOKENS
    tokens, logits, cached = run_batch(engine, prompts, MAX_TOKENS)
    _assert_matches(tokens, logits, references)
    assert all(c > 0 for c in cached), cached
    engine.cache.check_idle()


@pytest.mark.parametrize("opts", [{"max_num_batched_tokens": 7}, {"kv_slots": 160}],
                         ids=["chunked-prefill", "preemption"])
def test_chunked_prefill_and_preemption_match_hf(tiny_dirs, references, opts):
    engine = _engine(tiny_dirs, **opts)
    tokens, logits, _ = run_batch(engine, shared_prefix_prompts(), MAX_TOKENS)
    if "kv_slots" in opts:  # 8 prompts of up to 73 tokens + 12 outputs in 160 slots
        assert engine.scheduler.num_preemptions > 0
    _assert_matches(tokens, logits, references)
    engine.cache.check_idle()


def _mixed_requests():
    prompts = shared_prefix_prompts()
    kinds = [{"temperature": 0.0, "max_tokens": 9},
             {"temperature": 0.8, "seed": 7, "max_tokens": 14},
             {"temperature": 0.0, "max_tokens": 5, "ignore_eos": True},
             {"temperature": 1.0, "top_k": 5, "seed": 3, "max_tokens": 11},
             {"temperature": 0.0, "max_tokens": 16, "stop_token_ids": []},
             {"temperature": 0.7, "top_p": 0.9, "seed": 11, "max_tokens": 8},
             {"temperature": 0.0, "max_tokens": 1},
             {"temperature": 0.0, "max_tokens": 13}]
    return [(p, SamplingParams(**k)) for p, k in zip(prompts, kinds)]


def test_sampled_and_stopped_requests_equal_the_synchronous_engine(tiny_dirs):
    requests = _mixed_requests()
    sync = run_requests(LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]))), requests)
    # A stop id each request meets: its own third token (ends it early, with "stop").
    stopped = [(p, dataclasses.replace(sp, stop_token_ids=[t[2]])) if len(t) > 3 else (p, sp)
               for (p, sp), (t, _, _) in zip(requests, sync)]
    for reqs in (requests, stopped):
        want = run_requests(LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]))), reqs)
        got = run_requests(_engine(tiny_dirs), reqs)  # checks that no slot leaked
        for i, ((wt, _, wf), (gt, _, gf)) in enumerate(zip(want, got)):
            assert gt == wt, f"request {i}"
            assert gf.finish_reason == wf.finish_reason, f"request {i}"
    assert any(f.finish_reason == "stop" for _, _, f in want)


def _scored_requests():
    """Requests that read their token history or score their tokens: logprobs (top 0 to 3),
    prompt logprobs, the three penalties, greedy and seeded, some stopping on a token."""
    prompts = shared_prefix_prompts()
    kinds = [{"temperature": 0.0, "max_tokens": 9, "logprobs": 3},
             {"temperature": 0.8, "seed": 7, "max_tokens": 14, "logprobs": 0},
             {"temperature": 0.0, "max_tokens": 12, "presence_penalty": 1.5,
              "frequency_penalty": 1.0, "logprobs": 2, "ignore_eos": True},
             {"temperature": 0.0, "max_tokens": 11, "repetition_penalty": 1.8,
              "ignore_eos": True},
             {"temperature": 1.0, "seed": 3, "max_tokens": 10, "frequency_penalty": 2.0,
              "logprobs": 1},
             {"temperature": 0.0, "max_tokens": 6, "prompt_logprobs": 2, "logprobs": 1},
             {"temperature": 0.0, "max_tokens": 13},
             {"temperature": 0.0, "max_tokens": 16, "presence_penalty": -2.0,
              "prompt_logprobs": 0, "ignore_eos": True}]
    return [(p, SamplingParams(**k)) for p, k in zip(prompts, kinds)]


@pytest.mark.parametrize("opts", [{}, {"max_num_batched_tokens": 7}, {"kv_slots": 160}],
                         ids=["plain", "chunked-prefill", "preemption"])
def test_logprobs_and_penalties_overlap_and_equal_the_synchronous_engine(tiny_dirs, opts):
    """Logprobs, prompt logprobs and penalties do not stop overlap scheduling: the logprobs
    travel to the host beside the tokens, and the penalties' counts take the answer token
    still on the device (``PenaltyCounts.count``). Tokens, finish reasons,
    logprobs and prompt logprobs equal the synchronous engine's, cold and with the prefix
    cache warm."""
    requests = _scored_requests()
    sync = LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), **opts))
    want = scored_outputs(sync, requests, 2)
    engine = _engine(tiny_dirs, **opts)
    overlapped = spy_overlapped(engine)
    got = scored_outputs(engine, requests, 2)
    assert sum(overlapped) > 2 * MAX_TOKENS  # it overlapped throughout
    if "kv_slots" in opts:
        assert engine.scheduler.num_preemptions > 0
    assert_same_scored(got, want)
    for g, (_, sp) in zip(got[1], requests):  # one logprob per token, where asked
        assert len(g[1]) == (len(g[0]) if sp.logprobs is not None else 0)
        assert (g[2] is not None) is (sp.prompt_logprobs is not None)
    # the penalties changed what was generated (else the test would not check them)
    plain = [(p, dataclasses.replace(sp, presence_penalty=0.0, frequency_penalty=0.0,
                                     repetition_penalty=1.0)) for p, sp in requests]
    unpenalized = scored_outputs(LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), **opts)),
                           plain)[0]
    assert all(unpenalized[i][0] != want[0][i][0] for i in (2, 3, 7))


def test_abort_with_logprobs_in_flight_frees_slots(tiny_dirs):
    """A request asking for logprobs joins a batch in flight and stays overlapped; an abort
    of a row on the device frees its slots; the logprobs align with the tokens."""
    engine = _engine(tiny_dirs)
    prompts = shared_prefix_prompts()
    for i, p in enumerate(prompts[:4]):
        engine.add_request(f"a{i}", p, SamplingParams(max_tokens=20, temperature=0.0,
                                                      ignore_eos=True))
    toks: dict[str, list] = {}
    finals, logprobs = {}, []

    def step():
        for o in engine.step():
            toks.setdefault(o.rid, []).extend(o.new_token_ids)
            if o.rid == "lp" and o.logprobs:
                logprobs.extend(o.logprobs)
            if o.finished:
                finals[o.rid] = o

    for _ in range(4):
        step()
    assert engine.inflight is not None
    engine.abort_request("a1")  # its row is in the batch on the device
    engine.add_request("lp", prompts[5], SamplingParams(max_tokens=4, temperature=0.0,
                                                        logprobs=2, ignore_eos=True))
    step()
    assert engine.inflight is not None  # still overlapped
    while engine.has_unfinished_requests():
        step()
    engine.cache.check_idle()
    assert finals["a1"].finish_reason == "abort"
    assert all(len(toks[f"a{i}"]) == 20 for i in (0, 2, 3))
    sync = LLMEngine(EngineConfig(model=str(tiny_dirs["llama"])))
    want = run_requests(sync, [(prompts[i], SamplingParams(max_tokens=20, temperature=0.0,
                                                           ignore_eos=True)) for i in (0, 2, 3)]
                        + [(prompts[5], SamplingParams(max_tokens=4, temperature=0.0,
                                                       ignore_eos=True))])
    assert [toks[r] for r in ("a0", "a2", "a3", "lp")] == [t for t, _, _ in want]
    assert [lp.token_id for lp in logprobs] == toks["lp"]


def test_head_policy_sampling_does_not_overlap(tmp_path, tiny_dirs):
    from latentserve.engine import overlap
    from latentserve.latent.head_loop import set_policy_sampling
    from tests.support.head_models import save_head_model

    engine = LLMEngine(EngineConfig(model=str(save_head_model(tmp_path / "head")),
                                    overlap_schedule=True))
    engine.add_request("h", [5, 6, 7], SamplingParams(max_tokens=3))
    assert overlap.eligible(engine)  # heads settle their stop a step late (head_late.py)
    set_policy_sampling(engine.runner.model.latent_head, 0.0)  # DAgger / GRPO rollouts
    assert not overlap.eligible(engine)
    plain = _engine(tiny_dirs)
    plain.add_request("q", [5, 6], SamplingParams(max_tokens=3, logprobs=1,
                                                  prompt_logprobs=1))
    plain.add_request("r", [5, 6], SamplingParams(max_tokens=3, repetition_penalty=1.2))
    assert overlap.eligible(plain)  # logprobs and penalties overlap


def test_server_with_overlap_streams_what_the_synchronous_engine_generates(tiny_dirs):
    """``latentserve serve --overlap-schedule``: concurrent streamed and plain completions
    over HTTP give the synchronous engine's greedy tokens."""
    import concurrent.futures

    import openai

    from latentserve.cli import build_parser, engine_config
    from latentserve.models.checkpoint import load_tokenizer
    from latentserve.server.launch import start_server

    args = build_parser().parse_args(["serve", "--model", str(tiny_dirs["llama"]),
                                      "--overlap-schedule", "--max-num-seqs", "8"])
    config = engine_config(args)
    assert config.overlap_schedule
    prompts = shared_prefix_prompts()[:6]
    want = run_requests(LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]))),
                        [(p, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
                         for p in prompts])
    srv = start_server(config, timeout=300)
    try:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="x", max_retries=0)

        def ask(i):
            kw = {"model": str(tiny_dirs["llama"]), "prompt": prompts[i], "max_tokens": 10,
                  "temperature": 0.0, "extra_body": {"ignore_eos": True}}
            if i % 2:
                return "".join(c.choices[0].text for c in
                               client.completions.create(stream=True, **kw))
            return client.completions.create(**kw).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            texts = list(pool.map(ask, range(len(prompts))))
    finally:
        srv.stop()
    tok = load_tokenizer(tiny_dirs["llama"])
    assert texts == [tok.decode(t) for t, _, _ in want]


def test_failed_forward_keeps_the_batch_in_flight(tiny_dirs):
    """A forward that raises must not drop the batch in flight: a request it preempted
    (waiting, its last id still pending) would later feed the placeholder id -1 to the
    model. The waiting request goes on as with the synchronous engine."""
    want = fail_forward_after_preemption(
        LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), kv_slots=16)))
    got = fail_forward_after_preemption(_engine(tiny_dirs, kv_slots=16))
    assert got[1] == want[1] == {"a": "abort", "b": "length"}
    assert got[0]["b"] == want[0]["b"] and len(got[0]["b"]) == 10


def test_failed_sampling_rows_fail_like_the_synchronous_engine(tiny_dirs, monkeypatch):
    """A row whose sampling raises fails its request on the outputs of its own batch, as in
    the synchronous engine: the token before it still streams, and the discarded row of a
    request that already finished (sampled in overlap mode only) fails nothing."""
    from latentserve import sampling

    original = sampling.sample_with_logprobs
    fail_at = {"a": 2, "b": 3}  # output ids before the failing row: a's 3rd, b's 4th token

    def flaky(logits, reqs, *args, **kw):
        if any(fail_at.get(r.rid) == len(r.output_ids) for r in reqs):
            raise RuntimeError("probability tensor contains nan")
        return original(logits, reqs, *args, **kw)

    monkeypatch.setattr(sampling, "sample_with_logprobs", flaky)
    outs = []
    for engine in (LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]))), _engine(tiny_dirs)):
        engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0,
                                                          ignore_eos=True))
        engine.add_request("b", [8, 9], SamplingParams(max_tokens=3, temperature=0.0,
                                                       ignore_eos=True))
        got: dict[str, list] = {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                got.setdefault(o.rid, []).append((len(o.new_token_ids), o.finish_reason))
        engine.cache.check_idle()
        outs.append(got)
    want, got = outs
    assert want["a"] == [(1, None), (1, None), (0, "error")]
    assert want["b"] == [(1, None), (1, None), (1, "length")]  # never samples a 4th token
    assert got == want


def test_overlap_is_the_cuda_default_and_can_be_turned_off():
    """``overlap_schedule`` None: on exactly for CUDA (SGLang's default); the CLI's
    ``--overlap-schedule`` / ``--disable-overlap-schedule`` set it either way."""
    from latentserve.cli import build_parser, engine_config

    assert not EngineConfig(device="cpu").use_overlap_schedule
    assert EngineConfig(device="cuda").use_overlap_schedule
    assert not EngineConfig(device="cuda", overlap_schedule=False).use_overlap_schedule
    assert EngineConfig(overlap_schedule=True).use_overlap_schedule
    parse = build_parser().parse_args
    assert engine_config(parse(["serve"])).overlap_schedule is None
    assert engine_config(parse(["serve", "--overlap-schedule"])).overlap_schedule is True
    assert engine_config(parse(["serve", "--disable-overlap-schedule"])).overlap_schedule \
        is False
    with pytest.raises(SystemExit):
        parse(["serve", "--overlap-schedule", "--disable-overlap-schedule"])


def test_recorded_steps_are_the_same_in_both_modes(tiny_dirs):
    """``tests.support.tp_parity.run_requests`` drops overlap mode's discarded rows (a finished
    request's row in the batch launched before its last token was seen), so an overlap run
    compares step for step with a synchronous one (``assert_same``, as the GPU TP tests
    compare TP=1 on CUDA, where overlap is the default, with TP=2)."""
    from tests.support.tp_parity import assert_same

    requests = [(p, SamplingParams(max_tokens=4 + i, temperature=0.0, ignore_eos=True))
                for i, p in enumerate(shared_prefix_prompts()[:5])]
    sync = run_requests(LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]))), requests)
    over = run_requests(_engine(tiny_dirs), requests)
    assert [len(lg) for _, lg, _ in over] == [4 + i for i in range(5)]
    assert_same(sync, over)
