"""Token masks on CUDA: the bitmask applied on the device (xgrammar's Triton kernel) equals
the CPU result, and the engine's graph and overlap paths keep masked rows inside their
masks and unmasked rows exact."""

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
    llm = LLM(str(path), device="cuda", max_num_seqs=8)
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
