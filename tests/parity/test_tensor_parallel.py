"""Tensor parallelism on the CPU: an engine split over two processes (gloo; this process is
rank 0, one worker subprocess is rank 1) produces the same greedy tokens as the
single-process engine on the same checkpoint, its sampled logits agree within 1e-4 (fp32;
the all-reduce only changes the summation order), and every latent path agrees: COCONUT
feedback latents (computed on rank 0, broadcast), a compression head (the capture buffer on
every rank), Huginn recurrent banks with mixed depths and early exit. The TP=1 engines are
themselves checked against eager references in the other parity tests.
"""

import pytest
import torch

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.sampling_params import SamplingParams
from latentserve.testing.parity import shared_prefix_prompts


def _run(engine, requests):
    """Queue ``[(prompt, SamplingParams)]`` at once and run to completion. Returns per
    request ``(tokens, [logits row of every sampled step], final StepOutput)``."""
    runner, logits = engine.runner, {}
    original = runner.run

    def recording(batch):
        out, hidden = original(batch)
        for req, row in zip([r for r, s in zip(batch.reqs, batch.sample) if s], out):
            logits.setdefault(req.rid, []).append(row.float().cpu())
        return out, hidden

    runner.run = recording
    try:
        rids = [f"t{engine._arrivals + i}" for i in range(len(requests))]
        for rid, (prompt, params) in zip(rids, requests):
            engine.add_request(rid, prompt, params)
        toks, final = {r: [] for r in rids}, {}
        while engine.has_unfinished_requests():
            for o in engine.step():
                toks[o.rid] += o.new_token_ids
                if o.finished:
                    final[o.rid] = o
    finally:
        runner.run = original
    engine.cache.check_idle()
    return [(toks[r], logits[r], final[r]) for r in rids]


def _assert_same(tp1, tp2):
    for i, ((t1, l1, _), (t2, l2, _)) in enumerate(zip(tp1, tp2)):
        assert t2 == t1, f"request {i}: TP=2 {t2} != TP=1 {t1}"
        assert len(l2) == len(l1)
        for step, (a, b) in enumerate(zip(l1, l2)):
            torch.testing.assert_close(b, a, atol=1e-4, rtol=0, msg=f"request {i} step {step}")


def _pair(model_dir, **opts):
    """(TP=1 engine, TP=2 engine) on ``model_dir``; the caller shuts the TP one down."""
    cfg = dict(model=str(model_dir), kv_slots=4096, max_model_len=256, **opts)
    return LLMEngine(EngineConfig(**cfg)), LLMEngine(EngineConfig(**cfg, tensor_parallel_size=2))


def _greedy(**kw):
    return SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, **kw)


def test_llama_tp2_matches_tp1_cold_and_warm(tiny_dirs):
    """GQA (4 query / 2 KV heads, one KV head per rank), tied vocab-parallel embedding and
    head; the warm run reads prefixes from the radix cache (page-table rows sent to rank 1)."""
    one, two = _pair(tiny_dirs["llama"], max_num_batched_tokens=40)  # chunked prefill too
    try:
        reqs = [(p, _greedy()) for p in shared_prefix_prompts()]
        cold = _run(one, reqs)
        _assert_same(cold, _run(two, reqs))
        warm = _run(two, reqs)
        _assert_same(cold, warm)
        assert sum(o.num_cached_tokens for *_, o in warm) > 0
        with pytest.raises(ValueError, match="return_latent_trace"):
            two.add_request("x", [1, 2, 3], _greedy(return_latent_trace=True))
        with pytest.raises(ValueError, match="prompt_logprobs"):
            two.add_request("y", [1, 2, 3], _greedy(prompt_logprobs=1))
        two.cache.check_idle()
    finally:
        two.shutdown()


def test_coconut_gpt2_tp2_matches_tp1(tmp_path, smollm2_dir):
    from latentserve.testing.latent_models import save_latent_tiny

    d = save_latent_tiny(tmp_path / "coconut", "coconut-gpt2")
    one, two = _pair(d)
    try:
        prompts = shared_prefix_prompts()
        reqs = [(p, _greedy(latent_budget=b)) for p, b in zip(prompts, (0, 1, 3, 6, 2, 4, 5, 8))]
        _assert_same(_run(one, reqs), _run(two, reqs))
    finally:
        two.shutdown()


def test_compression_head_tp2_matches_tp1(tmp_path, smollm2_dir):
    from latentserve.testing.head_models import save_head_model

    d = save_head_model(tmp_path / "head", "llama")
    one, two = _pair(d)
    try:
        caps = (0, 3, 8, 5)
        reqs = [(p, _greedy(max_latent=caps[i % 4], min_latent=1, use_stop=i % 2 == 0,
                            min_output_tokens=0))
                for i, p in enumerate(shared_prefix_prompts())]
        a, b = _run(one, reqs), _run(two, reqs)
        _assert_same(a, b)
        assert [o.latent_stats for *_, o in b] == [o.latent_stats for *_, o in a]
        assert any(o.latent_stats["steps"] > 0 for *_, o in a)
    finally:
        two.shutdown()


def test_huginn_tp2_matches_tp1_with_depths_and_early_exit(tmp_path):
    from latentserve.testing.recurrent_models import write_huginn

    one, two = _pair(write_huginn(tmp_path / "huginn"))
    try:
        exits = [(8, "latent-diff", 0.2), (6, "kl", 0.01), (8, "entropy-diff", 0.05),
                 (8, "argmax-stability", 2), (2, None, None), (4, None, None)]
        prompts = [[(7 * i + 11 * j) % 900 + 20 for i in range(5 + 4 * j)] for j in range(6)]
        reqs = [(p, _greedy(latent_budget=d, exit_criterion=c, exit_threshold=t))
                for p, (d, c, t) in zip(prompts, exits)]
        a, b = _run(one, reqs), _run(two, reqs)
        _assert_same(a, b)
        assert [o.recurrence for *_, o in b] == [o.recurrence for *_, o in a]
        assert any(min(o.recurrence["histogram"]) < d for (*_, o), (d, *_) in zip(b, exits)), \
            "some request exits early"
    finally:
        two.shutdown()


def test_shard_model_names_the_size_that_does_not_divide(tiny_dirs):
    """4 query / 2 KV heads: TP=3 splits neither; the error names the field and the size."""
    from latentserve.distributed import TPGroup
    from latentserve.models.loader import load_model
    from latentserve.models.parallel import shard_model

    model, _ = load_model(tiny_dirs["llama"], torch.float32, "cpu")
    tp = TPGroup(rank=0, size=3, device=torch.device("cpu"), device_group=None, cpu_group=None)
    with pytest.raises(ValueError, match=r"num_attention_heads \(4\) must be divisible by "
                                         r"tensor_parallel_size \(3\)"):
        shard_model(model, tp)
    model, _ = load_model(tiny_dirs["llama"], torch.float32, "cpu")
    tp.size = 4  # heads split, the 2 KV heads do not
    with pytest.raises(ValueError, match=r"num_key_value_heads \(2\)"):
        shard_model(model, tp)


def test_tensor_parallel_size_must_be_positive():
    with pytest.raises(ValueError, match="tensor_parallel_size must be >= 1, got 0"):
        EngineConfig(tensor_parallel_size=0)
