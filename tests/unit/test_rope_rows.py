"""``ops.kernels.rope_rows`` (the RoPE table's rows at each position, the CUDA path of
``Rotary.cos_sin`` after ``build_table``) on CPU through the Triton interpreter: the rows
torch's indexing gives, bit for bit, with positions past either end clamped; bad input
raises. On the H200: ``tests/gpu/test_triton_gpu.py``."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch

from latentserve.ops.kernels.rope_rows import rope_rows
from tests.support.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()


@pytest.mark.parametrize("dtype,d", [(torch.float32, 32), (torch.bfloat16, 64),
                                     (torch.float16, 48)])
def test_rows_equal_torch_indexing(dtype, d):
    table = torch.randn(50, 2, d).to(dtype)
    pos = torch.tensor([0, 49, 7, 7, 60, -3, 1])
    got = rope_rows(table, pos)
    assert got.shape == (7, 2, d) and got.dtype == dtype
    assert torch.equal(got, table[pos.clamp(0, 49)])
    assert torch.equal(rope_rows(table, pos.int()), got)
    assert rope_rows(table, pos[:0]).shape == (0, 2, d)


def test_bad_input_raises():
    table = torch.randn(8, 2, 16)
    with pytest.raises(ValueError, match="table"):
        rope_rows(table[:, :, ::2], torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="positions"):
        rope_rows(table, torch.zeros(2, 1, dtype=torch.int64))
