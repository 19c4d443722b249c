"""``sampling.score_rows`` on CUDA (``ops.kernels.logprobs``) against its torch path on the
same device: SmolLM2's vocabulary, 64 rows, fp32 (and bf16) logits; equal targets, ranks and
top-k ids, log-probabilities within float32 rounding."""

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


# bf16 without top-k: its many tied values may be ordered otherwise by the two topk calls
@pytest.mark.parametrize("dtype,k", [(torch.float32, 0), (torch.float32, 5),
                                     (torch.float32, 20), (torch.bfloat16, 0)])
def test_kernels_equal_the_torch_path_on_cuda(dtype, k):
    from latentserve.sampling import score_rows, score_rows_torch

    g = torch.Generator(device="cuda").manual_seed(k)
    logits = (torch.randn(64, 49152, generator=g, device="cuda") * 3).to(dtype)
    targets = torch.randint(0, 49152, (64,), generator=g, device="cuda")
    got, want = score_rows(logits, targets, k), score_rows_torch(logits, targets, k)
    ids = [0, 2] + list(range(3, 3 + k))
    assert torch.equal(got[:, ids], want[:, ids])
    lps = [1] + list(range(3 + k, 3 + 2 * k))
    torch.testing.assert_close(got[:, lps], want[:, lps], rtol=0, atol=1e-5)
