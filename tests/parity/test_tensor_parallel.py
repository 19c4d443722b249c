"""Tensor parallelism on the CPU: an engine split over two processes (gloo; this process is
rank 0, one worker subprocess is rank 1) produces the same greedy tokens as the
single-process engine on the same checkpoint, its sampled logits agree within 1e-4 (fp32;
the all-reduce only changes the summation order), and every latent path agrees: COCONUT
feedback latents (computed on rank 0, broadcast), a compression head (the capture buffer on
every rank), Huginn (heads split unevenly) and Ouro recurrent banks with mixed depths, and
Huginn's early exit. The TP=1 engines are
themselves checked against eager references in the other parity tests.
"""

import dataclasses
import os
import subprocess

import pytest
import torch

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.sampling_params import SamplingParams
from tests.support.parity import shared_prefix_prompts
from tests.support.tp_parity import assert_same, run_requests


def _pair(model_dir, **opts):
    """(TP=1 engine, TP=2 engine) on ``model_dir``; the caller shuts the TP one down."""
    cfg = {"model": str(model_dir), "kv_slots": 4096, "max_model_len": 256, **opts}
    return LLMEngine(EngineConfig(**cfg)), LLMEngine(EngineConfig(**cfg, tensor_parallel_size=2))


def _greedy(max_tokens=8, **kw):
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def test_llama_tp2_matches_tp1_cold_and_warm(tiny_dirs):
    """GQA (4 query / 2 KV heads, one KV head per rank), tied vocab-parallel embedding and
    head; the warm run reads prefixes from the radix cache (page-table rows sent to rank 1).
    A 160-slot pool and 40-token chunks force chunked prefill, eviction and preemption."""
    one, two = _pair(tiny_dirs["llama"], max_num_batched_tokens=40, kv_slots=160)
    try:
        reqs = [(p, _greedy(max_tokens=12)) for p in shared_prefix_prompts()]
        cold = run_requests(one, reqs)
        assert_same(cold, run_requests(two, reqs))
        warm = run_requests(two, reqs)
        assert_same(cold, warm)
        assert sum(o.num_cached_tokens for *_, o in warm) > 0
        assert two.scheduler.num_preemptions > 0
        with pytest.raises(ValueError, match="return_latent_trace"):
            two.add_request("x", [1, 2, 3], _greedy(return_latent_trace=True))
        with pytest.raises(ValueError, match="prompt_logprobs"):
            two.add_request("y", [1, 2, 3], _greedy(prompt_logprobs=1))
        two.cache.check_idle()
    finally:
        two.shutdown()


def test_coconut_gpt2_tp2_matches_tp1(tmp_path, smollm2_dir):
    from latentserve.bench.baseline.latent_models import save_latent_tiny

    d = save_latent_tiny(tmp_path / "coconut", "coconut-gpt2")
    one, two = _pair(d)
    try:
        prompts = shared_prefix_prompts()
        reqs = [(p, _greedy(latent_budget=b)) for p, b in zip(prompts, (0, 1, 3, 6, 2, 4, 5, 8))]
        assert_same(run_requests(one, reqs), run_requests(two, reqs))
        with pytest.raises(ValueError, match="return_latent_trace .* feedback-latent"):
            two.add_request("x", [1, 2, 3], _greedy(latent_budget=2, return_latent_trace=True))
    finally:
        two.shutdown()


def test_compression_head_tp2_matches_tp1(tmp_path, smollm2_dir):
    from tests.support.head_models import save_head_model

    d = save_head_model(tmp_path / "head", "llama")
    one, two = _pair(d)
    try:
        caps = (0, 3, 8, 5)
        reqs = [(p, _greedy(max_latent=caps[i % 4], min_latent=1, use_stop=i % 2 == 0,
                            min_output_tokens=0))
                for i, p in enumerate(shared_prefix_prompts())]
        a, b = run_requests(one, reqs), run_requests(two, reqs)
        assert_same(a, b)
        # The stop head's probabilities (the largest, the last) come from a hidden state the
        # ranks reduce in another order: within 1e-5 (an Intel CPU's kernels differ in the
        # last bits), the rest of the stats exactly.
        for (*_, ob), (*_, oa) in zip(b, a):
            sb, sa = dict(ob.latent_stats), dict(oa.latent_stats)
            for key in ("max_stop_prob", "end_stop_prob"):
                pb, pa = sb.pop(key, None), sa.pop(key, None)
                assert (pb is None) == (pa is None) and (pb is None or abs(pb - pa) <= 1e-5)
            assert sb == sa
        assert any(o.latent_stats["steps"] > 0 for *_, o in a)
    finally:
        two.shutdown()


def test_huginn_tp2_matches_tp1_with_depths_and_early_exit(tmp_path):
    from latentserve.bench.baseline.recurrent_models import write_huginn

    # 3 heads: rank 0 takes 2, rank 1 one (the uneven split Huginn's 55 heads need).
    one, two = _pair(write_huginn(tmp_path / "huginn", n_embd=48, num_attention_heads=3,
                                  num_key_value_heads=3))
    try:
        exits = [(8, "latent-diff", 0.2), (6, "kl", 0.01), (8, "entropy-diff", 0.05),
                 (8, "argmax-stability", 2), (2, None, None), (4, None, None)]
        prompts = [[(7 * i + 11 * j) % 900 + 20 for i in range(5 + 4 * j)] for j in range(6)]
        # return_latent_trace (the recurrence stats over HTTP) is accepted under TP, and
        # both exit semantics (upstream's masks skipped steps' keys on every rank).
        semantics = ["engine", "upstream", "upstream", "engine", None, None]
        reqs = [(p, _greedy(latent_budget=d, exit_criterion=c, exit_threshold=t,
                            return_latent_trace=True, exit_semantics=s))
                for p, (d, c, t), s in zip(prompts, exits, semantics)]
        a, b = run_requests(one, reqs), run_requests(two, reqs)
        assert_same(a, b)
        assert [o.recurrence for *_, o in b] == [o.recurrence for *_, o in a]
        assert any(min(o.recurrence["histogram"]) < d for (*_, o), (d, *_) in zip(b, exits)), \
            "some request exits early"
        engine_only = [(p, dataclasses.replace(sp, exit_semantics="engine")) for p, sp in reqs]
        assert [o.recurrence for *_, o in run_requests(one, engine_only)] != \
            [o.recurrence for *_, o in a], "the upstream semantics change the depths here"
    finally:
        two.shutdown()


def test_ouro_tp2_matches_tp1_with_depths(tmp_path):
    from latentserve.bench.baseline.recurrent_models import write_ouro

    one, two = _pair(write_ouro(tmp_path / "ouro"))  # 4 query / 2 KV heads
    try:
        prompts = [[(5 * i + 13 * j) % 900 + 20 for i in range(4 + 5 * j)] for j in range(4)]
        reqs = [(p, _greedy(latent_budget=d)) for p, d in zip(prompts, (1, 2, 4, 6))]
        a, b = run_requests(one, reqs), run_requests(two, reqs)
        assert_same(a, b)
        assert [o.recurrence for *_, o in b] == [o.recurrence for *_, o in a]
    finally:
        two.shutdown()


def _tiny_llama(**overrides):
    from transformers import LlamaConfig

    from latentserve.models.llama import LlamaForCausalLM

    cfg = {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 64}
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **overrides}))


@pytest.mark.parametrize("overrides, size, error", [
    ({}, 3, r"num_key_value_heads \(2\) must be >= tensor_parallel_size \(3\)"),
    ({"num_key_value_heads": 4, "intermediate_size": 66}, 4,
     r"intermediate_size \(66\) must be divisible by tensor_parallel_size \(4\)"),
])
def test_shard_model_names_the_size_that_does_not_split(overrides, size, error):
    from latentserve.distributed import TPGroup
    from latentserve.models.parallel import shard_model

    tp = TPGroup(rank=0, size=size, device=torch.device("cpu"), device_group=None,
                 cpu_group=None)
    with pytest.raises(ValueError, match=error):
        shard_model(_tiny_llama(**overrides), tp)


def test_engine_that_cannot_split_fails_cleanly(tiny_dirs):
    """TP=3 over 2 KV heads: the engine raises the shard error, its workers are gone and the
    process group is left, so a later TP engine in this process can start."""
    import torch.distributed as dist

    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\) must be >= "
                                         r"tensor_parallel_size \(3\)"):
        LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), kv_slots=256,
                               tensor_parallel_size=3))
    assert not dist.is_initialized()
    left = subprocess.run(["pgrep", "-P", str(os.getpid()), "-f", "latentserve.engine.tp_worker"],
                          capture_output=True, text=True, check=False)
    assert left.stdout == "", f"workers left running: {left.stdout}"


def test_heads_split_unevenly_follow_their_kv_group():
    """6 query heads over 3 KV heads on 2 ranks: KV 2 + 1, queries 4 + 2 (Huginn's 55 heads
    split the same way)."""
    from latentserve.distributed import TPGroup
    from latentserve.models.parallel import head_split

    splits = [head_split(6, 3, TPGroup(r, 2, torch.device("cpu"), None, None)) for r in (0, 1)]
    assert splits == [(slice(0, 4), slice(0, 2)), (slice(4, 6), slice(2, 3))]


def test_tensor_parallel_size_must_be_positive():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0)


def test_dead_worker_ends_the_engine_loop_at_once(tiny_dirs):
    """A killed rank is not recovered: the server's engine loop reports ``EngineFailed``
    naming the rank on the failed step (or while idle), instead of failing each later
    request one by one while ``/health`` stays ok."""
    from latentserve.server.engine_process import EngineLoop
    from latentserve.server.messages import AddRequest, EngineFailed

    class Outbox:
        def __init__(self):
            self.messages = []

        def send_pyobj(self, message):
            self.messages.append(message)

    two = LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), kv_slots=256,
                                 tensor_parallel_size=2))
    try:
        loop = EngineLoop(two, inbox=None, outbox=Outbox())
        assert two.dead_workers() == [] and loop._workers_gone() is None
        two._tp_procs[0].kill()
        two._tp_procs[0].wait()
        assert two.dead_workers() == ["rank 1 (exit code -9)"]
        loop.handle(AddRequest("r", [5, 6, 7], _greedy()))
        with pytest.raises(RuntimeError):
            loop._step()
        assert loop.outbox.messages == [
            EngineFailed("tensor-parallel worker rank 1 (exit code -9) exited")]
    finally:
        from latentserve.engine.tp_worker import abort_workers

        two.tp = None
        abort_workers(two._tp_procs)
    assert two.dead_workers() == []
