"""Looped latent blocks (PCCoT on GPT-2 and Llama, LOTUS on Llama): the engine's greedy answers
and first-answer logits equal the eager full-recomputation reference
(``latentserve.bench.baseline.loop_reference``) for several block sizes and iteration counts, in
one batch mixing budgets (0 included) with the prefix cache cold and warm; the block's slots
are allocated once and reused by every pass; block positions never reach the prefix cache;
the slot invariant holds."""

import pytest
import torch

from latentserve.bench.baseline.loop_reference import load_pccot_reference
from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.sampling_params import SamplingParams
from tests.support.loop_models import load_lotus_reference, save_loop_tiny
from tests.support.loop_reference import reference_generate_loop
from tests.support.parity import shared_prefix_prompts

# kind -> block size (several sizes, 1 included)
KINDS = {"pccot-gpt2": 4, "pccot-llama": 3, "lotus-llama": 6, "lotus-llama-b1": 1}
BUDGETS = (0, 1, 2, 3, 5)
MAX_TOKENS = 6


def _requests():
    prompts = shared_prefix_prompts()
    reqs = [(p, BUDGETS[i % len(BUDGETS)]) for i, p in enumerate(prompts)]
    return reqs + [(prompts[0], b) for b in (0, 3, 5)]


@pytest.fixture(scope="module")
def loop_dirs(tmp_path_factory, smollm2_dir):
    pytest.importorskip("peft")  # not at import: peft loads triton before tests/unit's interpreter
    root = tmp_path_factory.mktemp("loop-parity")
    out = {}
    for kind, n in KINDS.items():
        out[kind] = save_loop_tiny(root / kind, kind.removesuffix("-b1"), block_size=n,
                                   iterations=2)
    return out


def _reference(model_dir):
    root = model_dir.parent
    if (root / "adapter").is_dir():
        return load_pccot_reference(str(root / "base"), str(root / "adapter"))
    return load_lotus_reference(str(model_dir))


@pytest.fixture(scope="module")
def references(loop_dirs):
    return {k: [reference_generate_loop(_reference(d), p, b, MAX_TOKENS) for p, b in _requests()]
            for k, d in loop_dirs.items()}


def _run(engine, reqs, chunk_budget=None):
    """Drive ``engine`` over ``reqs``; per request ``(answer ids, first-answer logits,
    num_cached_tokens, Req)``; also the slots handed out by the allocator during the run."""
    runner, last, allocated = engine.runner, {}, [0]
    allocator = engine.cache.allocator
    original, alloc = runner.run, allocator.alloc

    def recording_run(batch):
        logits, hidden = original(batch)
        last["reqs"] = [r.rid for r, s in zip(batch.reqs, batch.sample) if s]
        last["logits"] = logits
        return logits, hidden

    def counting_alloc(n):
        slots = alloc(n)
        allocated[0] += 0 if slots is None else n
        return slots

    rids = [f"q{engine._arrivals + i}" for i in range(len(reqs))]
    for rid, (prompt, budget) in zip(rids, reqs):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                       latent_budget=budget))
    objs = {r.rid: r for r in engine.scheduler.waiting}
    tokens, logits, cached = {r: [] for r in rids}, {}, {}
    runner.run, allocator.alloc = recording_run, counting_alloc
    try:
        while engine.has_unfinished_requests():
            last.clear()
            for out in engine.step():
                if out.new_token_ids and not tokens[out.rid]:
                    logits[out.rid] = last["logits"][last["reqs"].index(out.rid)].float().cpu()
                tokens[out.rid] += out.new_token_ids
                cached[out.rid] = out.num_cached_tokens
    finally:
        runner.run, allocator.alloc = original, alloc
    return [(tokens[r], logits[r], cached[r], objs[r]) for r in rids], allocated[0]


def _engine(model_dir, **kw):
    return LLMEngine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32", **kw))


@pytest.mark.parametrize("kind", list(KINDS))
def test_looped_block_matches_full_recompute_reference(kind, loop_dirs, references):
    engine = _engine(loop_dirs[kind])
    for warm in (False, True):
        results, _ = _run(engine, _requests())
        for (ans, logits, _cached, _), (ref_ans, ref_logits) in zip(results, references[kind]):
            assert ans == ref_ans
            torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
        if warm:
            assert sum(c for _, _, c, _ in results) > 0  # the shared prefixes were served
        engine.cache.check_idle()


def test_block_slots_are_allocated_once_and_reused_by_every_pass(loop_dirs):
    engine = _engine(loop_dirs["pccot-gpt2"], enable_prefix_caching=False)
    reqs = _requests()
    results, allocated = _run(engine, reqs)
    for (_, _, _, req), (_, budget) in zip(results, reqs):
        assert req.state.passes_done == budget + 1
        assert req.state.slot_checks == budget  # every pass after the first found the same slots
    # one slot per position ever laid down, nothing per pass (no preemption happened)
    assert engine.scheduler.num_preemptions == 0
    assert allocated == sum(len(r.ids) - 1 for _, _, _, r in results)  # last id: never run
    engine.cache.check_idle()


def test_prefix_cache_never_holds_block_positions(loop_dirs):
    """A prompt that spells out a finished request's prompt + bot + block ids is served from
    the cache only up to the block: the block's KV was rewritten from hidden states."""
    engine = _engine(loop_dirs["lotus-llama"])
    spec = engine.latent_spec
    prompt = shared_prefix_prompts()[0]
    _run(engine, [(prompt, 3)])
    results, _ = _run(engine, [(prompt + list(spec.start_ids)
                                + [spec.latent_id] * spec.block_size + [7], 1)])
    assert results[0][2] == len(prompt) + len(spec.start_ids)
    engine.cache.check_idle()


def test_chunked_and_preempted_passes_give_the_same_answers(loop_dirs, references):
    """A token budget smaller than a pass splits it into chunks; a pool too small for the
    batch preempts requests mid-loop; the answers do not change and no slot leaks."""
    kind = "lotus-llama"
    # 4 tokens per forward < block 6; 88 slots: room for the longest request (87 positions)
    # but not for the batch, so one request is preempted in the middle of its passes.
    engine = _engine(loop_dirs[kind], max_num_batched_tokens=4, kv_slots=88,
                     enable_prefix_caching=False)
    preempt, mid_loop = engine.scheduler._preempt, []

    def recording_preempt(req):
        mid_loop.append(req.answer_start is None and bool(req.output_ids))
        preempt(req)

    engine.scheduler._preempt = recording_preempt
    results, _ = _run(engine, _requests())
    for (ans, logits, _, _), (ref_ans, ref_logits) in zip(results, references[kind]):
        assert ans == ref_ans
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)
    assert any(mid_loop)  # some request lost its block's slots between passes
    engine.cache.check_idle()


def test_budget_above_the_cap_is_rejected_naming_the_field(loop_dirs):
    engine = _engine(loop_dirs["pccot-gpt2"])
    with pytest.raises(ValueError, match="latent_budget must be in \\[0, 64\\]"):
        engine.add_request("x", [1, 2, 3], SamplingParams(latent_budget=65))
    assert not engine.has_unfinished_requests()
    engine.cache.check_idle()


def test_thinking_off_is_refused_the_block_always_runs(loop_dirs):
    engine = _engine(loop_dirs["pccot-gpt2"])
    with pytest.raises(ValueError, match="thinking cannot be false on a looped-block model"):
        engine.add_request("x", [1, 2, 3], SamplingParams(thinking=False))
    assert not engine.has_unfinished_requests()
    engine.cache.check_idle()


def test_offline_llm_serves_mixed_budgets_and_reports_block_positions(loop_dirs, references):
    """The user path: ``LLM.generate`` with one ``SamplingParams`` per prompt; the engine's
    final outputs count block size x passes as latent steps."""
    from latentserve import LLM

    kind = "pccot-llama"
    llm = LLM(str(loop_dirs[kind]), device="cpu", dtype="float32")
    reqs = _requests()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs],
                        [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, latent_budget=b)
                         for _, b in reqs], use_tqdm=False)
    for out, (ref_ans, _) in zip(outs, references[kind]):
        assert list(out.outputs[0].token_ids) == ref_ans
    engine = llm.engine
    engine.add_request("s", reqs[0][0], SamplingParams(max_tokens=2, latent_budget=3))
    final = [o for _ in range(50) for o in engine.step() if o.finished]
    assert final[0].latent_steps == KINDS[kind] * 4
    engine.cache.check_idle()


@pytest.mark.parametrize("kind", ["pccot-gpt2", "lotus-llama"])
def test_traced_passes_carry_each_block_positions_logit_lens(kind, loop_dirs):
    """``return_latent_trace``: one entry per block position per pass (``iterations + 1``
    passes), in pass order, each the logit lens of that position's output in that pass:
    the reference's top-5 block logits of the same pass within 1e-4, their softmax
    probabilities too; untraced requests in the same batch get none."""
    ref = _reference(loop_dirs[kind])
    n = KINDS[kind]
    prompts = shared_prefix_prompts()[:3]
    budgets = [0, 2, 3]
    engine = _engine(loop_dirs[kind])
    for i, (p, b) in enumerate(zip(prompts, budgets)):
        engine.add_request(f"t{i}", p, SamplingParams(max_tokens=2, temperature=0.0,
                                                      latent_budget=b,
                                                      return_latent_trace=i != 2))
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.rid] = out
    assert final["t2"].latent_trace is None
    for i in range(2):
        passes = []
        reference_generate_loop(ref, prompts[i], budgets[i], 2, passes=passes)
        trace = final[f"t{i}"].latent_trace
        assert len(passes) == budgets[i] + 1 and len(trace) == n * len(passes)
        assert final[f"t{i}"].latent_steps == len(trace)
        for k, e in enumerate(trace):
            p, j = divmod(k, n)
            assert (e["pass"], e["position"]) == (p + 1, j + 1)
            want = passes[p][j]
            top = want.topk(5)
            got = torch.tensor([v for _, v in e["top_tokens"]])
            torch.testing.assert_close(got, top.values, atol=1e-4, rtol=0)
            assert [t for t, _ in e["top_tokens"]] == top.indices.tolist()
            probs = (top.values - want.logsumexp(-1)).exp()
            torch.testing.assert_close(torch.tensor(e["top_probs"]), probs, atol=1e-4, rtol=0)
            assert e["norm"] > 0
        # Passes differ: the lens reads what each pass rewrote.
        if budgets[i]:
            assert trace[0]["top_tokens"] != trace[-n]["top_tokens"]
    engine.cache.check_idle()
