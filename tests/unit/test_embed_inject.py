"""``ops.kernels.embed_inject``: the embedding lookup with latent rows swapped in equals
``layers.inject(embedding(ids), input_embeds, latent_mask)`` bit for bit (Triton
interpreter on CPU), and bad arguments name the field."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch
import torch.nn.functional as F

from latentserve.models.layers import inject
from latentserve.ops.kernels.embed_inject import embed_inject
from tests.support.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("latent_dtype", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [64, 1500])
def test_equals_embedding_then_inject(dtype, latent_dtype, hidden):
    g = torch.Generator().manual_seed(hidden)
    weight = torch.randn(300, hidden, generator=g).to(dtype)
    ids = torch.randint(0, 300, (9,), generator=g)
    embeds = mask = None
    if latent_dtype is not None:
        embeds = torch.randn(9, hidden, generator=g).to(latent_dtype)
        mask = torch.rand(9, generator=g) < 0.5
        mask[0], mask[1] = True, False
    out = embed_inject(weight, ids, embeds, mask)
    want = inject(F.embedding(ids, weight), embeds, mask)
    assert out.dtype == dtype and torch.equal(out, want)


def test_empty_batch_and_int32_ids():
    weight = torch.randn(10, 8)
    assert embed_inject(weight, torch.zeros(0, dtype=torch.int64), None, None).shape == (0, 8)
    ids = torch.tensor([3, 9, 0], dtype=torch.int32)
    assert torch.equal(embed_inject(weight, ids, None, None), weight[ids.long()])


@pytest.mark.parametrize("args,match", [
    (dict(weight=torch.zeros(4)), "weight must be"),
    (dict(ids=torch.zeros(2, 2, dtype=torch.int64)), "ids must be"),
    (dict(input_embeds=torch.zeros(3, 5)), "input_embeds must be"),
    (dict(input_embeds=torch.zeros(3, 8)), "latent_mask must be"),
])
def test_bad_arguments_name_the_field(args, match):
    kw = dict(weight=torch.zeros(10, 8), ids=torch.zeros(3, dtype=torch.int64),
              input_embeds=None, latent_mask=None)
    kw.update(args)
    with pytest.raises(ValueError, match=match):
        embed_inject(**kw)


def test_fused_coconut_llama_latent_steps_match_the_reference_loop(tmp_path, monkeypatch):
    """On the fast path (``fused_ops``, Triton attention, interpreter) a COCONUT Llama
    feeds its latent vectors through ``embed_inject``: greedy answers and first-answer
    logits equal the eager per-request reference loop (fp32, 1e-4), for a mixed-budget
    batch."""
    from latentserve.bench.baseline.latent_models import save_latent_tiny
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.ops.kernels import embed_inject as module
    from latentserve.sampling_params import SamplingParams
    from tests.support.latent_reference import reference_generate
    from tests.support.parity import shared_prefix_prompts

    latent_calls, real = [], module.embed_inject
    monkeypatch.setattr(module, "embed_inject", lambda w, ids, e, m: (
        latent_calls.append(e is not None) or real(w, ids, e, m)))
    path = save_latent_tiny(tmp_path, "coconut-llama")
    engine = LLMEngine(EngineConfig(model=str(path), fused_ops=True,
                                    attention_backend="triton"))
    assert engine.runner.model.model.norm.fused
    runner, first = engine.runner, {}
    original = runner.run

    def recording_run(batch, *args):
        logits, hidden = original(batch, *args)
        rids = [r.rid for r, s in zip(batch.reqs, batch.sample) if s]
        for rid, row in zip(rids, logits):
            first.setdefault(rid, []).append(row.float().clone())
        return logits, hidden

    runner.run = recording_run
    reqs = list(zip(shared_prefix_prompts()[:3], (2, 0, 3)))
    for i, (p, b) in enumerate(reqs):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=3, temperature=0.0,
                                                      latent_budget=b))
    tokens = {f"r{i}": [] for i in range(len(reqs))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.rid] += out.new_token_ids
    for i, (p, b) in enumerate(reqs):
        ref_tokens, ref_logits = reference_generate(path, p, b, 3)
        assert tokens[f"r{i}"] == ref_tokens, f"request {i} (budget {b})"
        # the first-answer logits: the sampling row whose argmax is the first answer token
        rows = [x for x in first[f"r{i}"] if int(x.argmax()) == ref_tokens[0]]
        assert any(torch.allclose(x, ref_logits, atol=1e-4, rtol=0) for x in rows), \
            f"request {i}: no sampling row within 1e-4 of the reference's first answer logits"
    assert any(latent_calls), "no step injected latent vectors through the kernel"
    engine.cache.check_idle()
