"""Token masks on CUDA: the bitmask applied on the device (xgrammar's Triton kernel) equals
the CPU result, the engine's graph and overlap paths keep masked rows inside their masks
and unmasked rows exact, and overlapped grammar rows hold their grammars."""

import dataclasses

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu

VOCAB = 4224


def test_cuda_mask_equals_cpu_mask():
    pytest.importorskip("xgrammar")  # its Triton kernel is what runs on the device
    from latentserve.sampling import TokenMask, apply_token_mask
    from latentserve.token_masks import ids_bitmask

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(8, VOCAB, generator=g)
    rows = [1, 4, 5]
    bits = np.stack([ids_bitmask(range(k, VOCAB, 7 + k), VOCAB) for k in rows])
    cpu = apply_token_mask(logits, TokenMask(rows, torch.from_numpy(bits)))
    gpu = apply_token_mask(logits.cuda(), TokenMask(rows, torch.from_numpy(bits).cuda()))
    assert torch.equal(gpu.cpu(), cpu)


def test_engine_on_cuda_keeps_masks_and_unmasked_rows_exact(tmp_path):
    from latentserve import LLM, SamplingParams
    from latentserve.bench.baseline.tiny_models import save_tiny

    path = save_tiny(tmp_path / "m", "llama", word_tokenizer=True, vocab_size=VOCAB)
    llm = LLM(str(path), device="cuda", max_num_seqs=8, kv_slots=4096)  # not 90% of the GPU
    prompts = [{"prompt_token_ids": [5 + i, 9, 11 + i]} for i in range(4)]
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain, use_tqdm=False)]
    allowed = [7, 70, 700, 4000]
    masked = SamplingParams(max_tokens=12, temperature=1.0, seed=1, allowed_token_ids=allowed,
                            min_tokens=12)
    outs = llm.generate(prompts + prompts, [plain] * 4 + [masked] * 4, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:4]] == alone
    for o in outs[4:]:
        assert len(o.outputs[0].token_ids) == 12 and set(o.outputs[0].token_ids) <= set(allowed)


def test_overlapped_grammar_rows_on_cuda_hold_their_grammars(tiny_dirs, monkeypatch):
    """Overlapped on CUDA (graphs; a grammar's rows are built on the worker beside the
    forward once the previous tokens are on the host, or after its launch): grammars, a
    static mask and plain rows, greedy and seeded, with an abort mid-grammar; every grammar
    row's tokens are accepted by a fresh matcher, the static rows stay in their ids, the
    masks were built from pending ids, no KV slot leaks."""
    pytest.importorskip("xgrammar")
    from latentserve import token_masks
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.sampling_params import SamplingParams

    schema = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "b": {"type": "string", "maxLength": 5}},
              "required": ["a", "b"]}
    allowed = [11, 257, 1000]
    kinds = [{"temperature": 0}, {"structured_outputs": {"json": schema}},
             {"structured_outputs": {"regex": "[a-z]{2,5}( [a-z]{2,5}){0,5}"}},
             {"allowed_token_ids": allowed, "min_tokens": 4}]
    params = [SamplingParams(max_tokens=24, **k, **({} if "temperature" in k else
                                                     {"temperature": 1.0, "seed": j}
                                                     if j % 2 else {"temperature": 0}))
              for j, k in enumerate(kinds * 4)]
    engine = LLMEngine(EngineConfig(model=str(tiny_dirs["llama"]), device="cuda",
                                    max_num_seqs=16, kv_slots=16 * 512))
    assert engine.config.use_overlap_schedule
    real, pending = token_masks.begin_bitmask, []

    def begin_bitmask(reqs, vocab_size, known=None, out=None, background=False):
        pending.append(known is not None)  # built (on the worker when background) from them
        return real(reqs, vocab_size, known, out, background)

    monkeypatch.setattr(token_masks, "begin_bitmask", begin_bitmask)
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [1 + (i * 13 + k) % 900 for k in range(9 + i)], p)
    out: dict = {f"r{i}": [[], None] for i in range(len(params))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.rid][0].extend(o.new_token_ids)
            if o.finished:
                out[o.rid][1] = o.finish_reason
        if len(out["r5"][0]) >= 3 and out["r5"][1] is None:
            engine.abort_request("r5")
    engine.cache.check_idle()
    assert any(pending)
    assert out["r5"][1] == "abort"
    for (toks, reason), p in zip(out.values(), params):
        assert toks and reason is not None
        if p.structured_outputs is not None:
            matcher = engine.grammars.matcher(p.structured_outputs)
            assert all(matcher.accept_token(t) for t in toks), toks
        elif p.allowed_token_ids is not None:
            assert set(toks) <= set(allowed)


def test_logit_bias_on_cuda_forces_ids_and_leaves_unbiased_rows_exact(tmp_path):
    """``logit_bias`` through the CUDA graph and overlap path (the packed int64/float64 copy,
    ``logit_bias.py``): +100 on an id makes greedy pick it every step, -100 keeps an id out
    of seeded samples, and the unbiased rows get the tokens of the same batch without any
    bias (same shapes, no prefix cache: bf16 numerics follow the batch)."""
    from latentserve import LLM, SamplingParams
    from latentserve.bench.baseline.tiny_models import save_tiny

    path = save_tiny(tmp_path / "m", "llama", word_tokenizer=True, vocab_size=VOCAB)
    prompts = [{"prompt_token_ids": [5 + i, 9, 11 + i]} for i in range(12)]
    plain = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    biases = [None] * 4 + [{700: 100.0}] * 4 + [{7: 5.0, 70: -100.0, 4000: 3.5}] * 4
    llm = LLM(str(path), device="cuda", max_num_seqs=12, enable_prefix_caching=False,
              kv_slots=4096)

    def run(with_bias: bool) -> list[list[int]]:
        params = [dataclasses.replace(plain if i < 8 else sampled,
                                      logit_bias=b if with_bias else None)
                  for i, b in enumerate(biases)]
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    free, biased = run(False), run(True)
    assert biased[:4] == free[:4], (biased[:4], free[:4])
    assert all(t == [700] * 10 for t in biased[4:8]), biased[4:8]
    assert all(70 not in t for t in biased[8:]), biased[8:]
