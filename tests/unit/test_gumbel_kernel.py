"""``ops.kernels.gumbel.gumbel_sample_rows`` (temperature sampling's token pick on CUDA) on
CPU through the Triton interpreter: draws follow ``softmax(logits / T)`` (a chi-square test
over many rows), one seed gives one set of tokens and another seed others, per-row
temperatures apply to their rows, -inf logits are never drawn, chunks cut short, and bad
arguments are refused by name."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch

from latentserve.ops.kernels.gumbel import gumbel_sample_rows
from tests.support.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()


def _chi_square(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() * tokens.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0, "a token of probability 0 was drawn"
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


def test_draws_follow_the_tempered_softmax():
    """800 rows of one 6-token row of logits, half at temperature 1 and half at 0.5 (chunks
    of 4 columns: one cut short): each half's counts match ``softmax(logits / T)``
    (chi-square, 5 degrees of freedom, under 20.5 = p 0.001)."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.25, 0.75])
    temps = torch.tensor([1.0, 0.5]).repeat_interleave(400)
    tokens = gumbel_sample_rows(logits.repeat(800, 1), temps, seed=123, block=16)
    assert tokens.dtype == torch.int64 and tokens.shape == (800,)
    for half, t in ((tokens[:400], 1.0), (tokens[400:], 0.5)):
        assert _chi_square(half, torch.softmax(logits / t, -1)) < 20.5, t


def test_same_seed_same_tokens_other_seed_other_tokens():
    x = torch.randn(32, 100, generator=torch.Generator().manual_seed(0))
    a = gumbel_sample_rows(x, 1.0, seed=7, block=64)
    assert torch.equal(a, gumbel_sample_rows(x, 1.0, seed=7, block=64))
    assert not torch.equal(a, gumbel_sample_rows(x, 1.0, seed=8, block=64))


def test_rows_of_one_batch_draw_independently():
    """Equal rows in one batch do not all take the same token (each row has its own stream)."""
    x = torch.zeros(40, 50)
    assert len(set(gumbel_sample_rows(x, 1.0, seed=3, block=64).tolist())) > 15


def test_masked_tokens_are_never_drawn_and_an_all_masked_row_gives_0():
    x = torch.randn(100, 40, generator=torch.Generator().manual_seed(1))
    x[:, ::2] = float("-inf")  # only odd ids allowed
    x[5] = float("-inf")
    tokens = gumbel_sample_rows(x, 1.0, seed=11, block=64)
    assert tokens[5] == 0
    assert all(t % 2 == 1 for i, t in enumerate(tokens.tolist()) if i != 5)


def test_per_row_temperatures():
    """A near-zero temperature picks the argmax; a large one spreads over the vocabulary."""
    x = torch.randn(100, 30, generator=torch.Generator().manual_seed(2)) * 3
    temps = torch.tensor([1e-4, 100.0] * 50)
    tokens = gumbel_sample_rows(x, temps, seed=5, block=32)
    assert torch.equal(tokens[0::2], x[0::2].argmax(-1))
    assert (tokens[1::2] != x[1::2].argmax(-1)).float().mean() > 0.8


def test_bf16_logits_and_a_strided_row():
    x = torch.randn(8, 64, generator=torch.Generator().manual_seed(4))
    big = torch.zeros(8, 80)
    big[:, :64] = x
    view = big[:, :64]  # row stride 80, last dim contiguous
    a = gumbel_sample_rows(view, 1e-4, seed=9, block=16)
    assert torch.equal(a, x.argmax(-1))
    b = gumbel_sample_rows(x.to(torch.bfloat16), 1e-4, seed=9, block=16)
    assert torch.equal(b, x.to(torch.bfloat16).float().argmax(-1))


@pytest.mark.parametrize("kwargs, field", [
    ({"logits": torch.zeros(2, 3, dtype=torch.int64)}, "logits"),
    ({"logits": torch.zeros(3)}, "logits"),
    ({"logits": torch.zeros(3, 4).t()}, "logits"),
    ({"temperature": 0.0}, "temperature"),
    ({"temperature": torch.ones(3)}, "temperature"),
    ({"temperature": torch.ones(2, dtype=torch.float64)}, "temperature"),
    ({"seed": -1}, "seed"),
    ({"block": 24}, "block"),
])
def test_bad_arguments_are_refused(kwargs, field):
    args = {"logits": torch.zeros(2, 4), "temperature": 1.0, "seed": 0, "block": 16, **kwargs}
    with pytest.raises(ValueError, match=field):
        gumbel_sample_rows(**args)


def test_a_bitmask_in_the_race_draws_the_allowed_softmax():
    """``bits`` allowing ids 1, 4 and 5 of a 6-token row: 600 draws follow the softmax over
    those three (chi-square, 2 degrees of freedom, under 13.8 = p 0.001); a row of no
    allowed id gives 0; a bad mask is refused by name."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 0.25, 0.75])
    bits = torch.full((601, 1), (1 << 1) | (1 << 4) | (1 << 5), dtype=torch.int32)
    bits[600] = 0
    tokens = gumbel_sample_rows(logits.repeat(601, 1), 1.0, seed=321, block=16, bits=bits)
    allowed = torch.full_like(logits, float("-inf"))
    allowed[[1, 4, 5]] = logits[[1, 4, 5]]
    assert tokens[600] == 0
    assert _chi_square(tokens[:600], torch.softmax(allowed, -1)) < 13.8
    with pytest.raises(ValueError, match="bits must be"):
        gumbel_sample_rows(logits.repeat(2, 1), 1.0, seed=1, bits=bits[:3])
