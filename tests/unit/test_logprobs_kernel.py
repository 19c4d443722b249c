"""``ops.kernels.logprobs.score_rows_cuda`` (the CUDA path of ``sampling.score_rows``) on CPU
through the Triton interpreter, against the torch path: the same targets, ranks and top-k
ids, log-probabilities within float32 rounding, over chunks cut short, k of 0, 1 and more
than the vocabulary, and fp32 and bf16 logits."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch

from latentserve.ops.kernels import logprobs as kernels
from latentserve.sampling import score_rows_torch
from tests.support.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()


@pytest.mark.parametrize("k", [0, 1, 5, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernels_equal_the_torch_path(monkeypatch, k, dtype):
    monkeypatch.setattr(kernels, "BLOCK", 64)  # 250 columns: four chunks, the last short
    g = torch.Generator().manual_seed(k)
    logits = (torch.randn(6, 250, generator=g) * 4).to(dtype)
    targets = torch.randint(0, 250, (6,), generator=g)
    got = kernels.score_rows_cuda(logits, targets, k)
    want = score_rows_torch(logits, targets, k)
    assert got.shape == want.shape == (6, 3 + 2 * min(k, 250))
    ids = [0, 2] + list(range(3, 3 + min(k, 250)))
    assert torch.equal(got[:, ids], want[:, ids])
    lps = [1] + list(range(3 + min(k, 250), got.shape[1]))
    torch.testing.assert_close(got[:, lps], want[:, lps], rtol=0, atol=1e-5)
