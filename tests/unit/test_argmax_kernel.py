"""``ops.kernels.argmax.argmax_rows`` (greedy sampling's token pick on CUDA) on CPU through
the Triton interpreter: the indices ``torch.argmax`` gives, bit for bit, including ties
(the first maximum), NaN rows (the first NaN, whatever its sign bit), all -inf rows, -0.0
tied with +0.0, rows shorter than one chunk and a last chunk cut short. On the H200:
``tests/gpu/test_triton_gpu.py``."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch

from latentserve.ops.kernels.argmax import argmax_rows
from tests.support.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()


def _cases(dtype, v, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(11, v, generator=g).to(dtype)
    x[1, [3, v - 1]] = 50.0  # a tie: the first wins
    x[2, [v - 1, v // 2]] = 60.0  # a tie across chunks
    x[3, [v - 2, 5]] = float("nan")  # NaN beats numbers; the first NaN wins
    x[3, 0] = float("inf")
    x[4] = float("-inf")  # nothing above -inf: index 0
    x[5, v - 1] = float("inf")
    x[6] = 7.0  # constant row
    x[7, v // 3] = -float("inf")
    x[8, 1:] = -1e30
    x[9] = -1.0
    x[9, [v - 1, 2, 4]] = torch.tensor([0.0, -0.0, 0.0]).to(dtype)  # -0.0 == +0.0: the first
    x[10, [v - 1, 3]] = -float("nan")  # a NaN with its sign bit set is a NaN too
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("v,block", [(1000, 128), (1000, 1024), (517, 64), (7, 16)])
def test_equals_torch_argmax(dtype, v, block):
    x = _cases(dtype, v, seed=v)
    got = argmax_rows(x, block=block)
    assert got.dtype == torch.int64 and got.shape == (11,)
    assert torch.equal(got, x.argmax(dim=-1))


def test_empty_batch_and_bad_arguments():
    assert argmax_rows(torch.zeros(0, 10)).shape == (0,)
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        argmax_rows(torch.zeros(4))
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        argmax_rows(torch.zeros(4, 6)[:, ::2])
    with pytest.raises(ValueError, match="float64"):
        argmax_rows(torch.zeros(2, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match="block"):
        argmax_rows(torch.zeros(2, 6), block=24)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,block_n", [(6, 100, 16), (70, 40, 32)])
def test_lm_head_epilogue_argmax_equals_torch_argmax_of_its_logits(dtype, m, n, block_n):
    """``decode_linear_argmax``: the LM head's epilogue finds each column tile's first
    maximum, a PDL kernel the row's. One-hot rows of x make the logits the weight's columns
    exactly, so rows carry ties within and across tiles (the first wins), -0.0 tied with
    +0.0 and a last tile cut short; a bias with a NaN, a sign-bit NaN and +inf tests those
    in every row of the second call (70 rows: two row tiles)."""
    from latentserve.ops.kernels.decode_linear import decode_linear, decode_linear_argmax

    k = 80 if m > 64 else 16
    x = torch.zeros(m, k, dtype=dtype)
    x[torch.arange(m), torch.arange(m) % k] = 1.0
    want = _cases(torch.float32, n, seed=n)[[1, 2, 6, 7, 8, 9]].nan_to_num(0.0, 1e4, -1e4)
    logits = torch.randn(m, n, generator=torch.Generator().manual_seed(m))
    logits[: len(want)] = want
    w = torch.zeros(n, k, dtype=dtype)
    w[:, : min(m, k)] = logits[: min(m, k)].T.to(dtype)
    bias = torch.zeros(n, dtype=dtype)
    for b in (None, bias, bias.index_put((torch.tensor([3, n - 2, n // 2]),),
                                         torch.tensor([float("nan"), -float("nan"),
                                                       float("inf")]).to(dtype))):
        y, ids = decode_linear_argmax(x, w, b, out_dtype=torch.float32, block_n=block_n)
        ref = decode_linear(x, w, b, out_dtype=torch.float32, block_n=block_n, split_k=1)
        assert torch.equal(y.nan_to_num(7.5), ref.nan_to_num(7.5))
        assert ids.dtype == torch.int64 and torch.equal(ids, y.argmax(dim=-1))
    assert ids.eq(3).all()  # the first NaN, in every row


def test_argmax_of_chunks_rejects_bad_buffers():
    from latentserve.ops.kernels.argmax import argmax_of_chunks

    with pytest.raises(ValueError, match="float32 and int32"):
        argmax_of_chunks(torch.zeros(2, 3), torch.zeros(2, 3, dtype=torch.int64), 10)
    with pytest.raises(ValueError, match="float32 and int32"):
        argmax_of_chunks(torch.zeros(2, 3), torch.zeros(3, 2, dtype=torch.int32), 10)


@pytest.mark.parametrize("v,block", [(1000, 128), (70, 16)])
def test_a_token_mask_equals_masking_then_torch_argmax(v, block):
    """``bits`` read as -inf where they disallow: the indices of ``apply_token_mask`` then
    ``torch.argmax``, also for a row whose best tokens are masked, a row that allows nothing
    (index 0), a masked NaN and words short of the vocabulary (columns past them masked)."""
    from latentserve.sampling import TokenMask, apply_token_mask
    from latentserve.token_masks import bitmask_width

    x = _cases(torch.float32, v, seed=v + 1)
    g = torch.Generator().manual_seed(v)
    bits = torch.randint(-2**31, 2**31 - 1, (11, bitmask_width(v)), generator=g,
                         dtype=torch.int64).to(torch.int32)
    bits[0] = 0  # nothing allowed
    bits[3] = -1  # the NaN row unmasked, then its NaNs masked in row 10
    bits[10, (v - 1) // 32] = 0
    bits[10, 3 // 32] &= ~(1 << 3)
    want = apply_token_mask(x, TokenMask(list(range(11)), bits)).argmax(dim=-1)
    assert torch.equal(argmax_rows(x, block=block, bits=bits), want)
    short = bits[:, :1].contiguous()  # only ids 0..31 may be taken
    want = apply_token_mask(x, TokenMask(list(range(11)), short)).argmax(dim=-1)
    assert torch.equal(argmax_rows(x, block=block, bits=short), want)
    with pytest.raises(ValueError, match="bits must be"):
        argmax_rows(x, bits=bits[:3])
