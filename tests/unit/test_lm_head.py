"""``ops.kernels.lm_head`` (the persistent LM head with the argmax's first pass in its
epilogue) on CPU through the Triton interpreter, TMA descriptors emulated: its logits equal
``decode_linear``'s unsplit ones bit for bit and its tile maxima give ``torch.argmax``,
with programs that walk several tiles and a last tile cut short. On the H200:
``tests/gpu/test_triton_gpu.py``."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch

from latentserve.ops.kernels.argmax import argmax_of_chunks
from latentserve.ops.kernels.decode_linear import decode_linear, decode_linear_argmax
from latentserve.ops.kernels.lm_head import lm_head_partials
from tests.support.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()


@pytest.mark.parametrize("m,n,k,programs", [(5, 300, 64, 3), (64, 130, 48, 2), (1, 40, 32, 8)])
def test_persistent_lm_head_equals_decode_linear(m, n, k, programs):
    g = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    w[n - 1] = w[2]  # a tie across tiles: the first wins
    ref = decode_linear(x, w, b, out_dtype=torch.float32, block_n=32, block_k=32, split_k=1)
    y = torch.empty(m, n)
    vals, idx = lm_head_partials(x, w, b, y, block_n=32, block_k=32, programs=programs)
    assert torch.equal(y, ref)
    assert vals.shape == idx.shape == (m, -(-n // 32))
    assert torch.equal(argmax_of_chunks(vals, idx, n), ref.argmax(dim=-1))


def test_decode_linear_argmax_takes_it_when_asked(monkeypatch):
    monkeypatch.setenv("LATENTSERVE_DECODE_TMA", "1")
    from latentserve.ops.kernels import lm_head

    calls = []
    monkeypatch.setattr(lm_head, "lm_head_partials",
                        lambda *a, **kw: calls.append(1) or lm_head_partials(*a, **kw))
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(3, 64, generator=g).bfloat16(), torch.randn(200, 64, generator=g).bfloat16()
    for mode in ("tiled", "persistent"):
        monkeypatch.setenv("LATENTSERVE_LMHEAD", mode)
        y, ids = decode_linear_argmax(x, w, out_dtype=torch.float32)
        assert torch.equal(y, decode_linear(x, w, out_dtype=torch.float32, split_k=1))
        assert torch.equal(ids, y.argmax(dim=-1))
        assert len(calls) == (mode == "persistent")


def test_rejects_what_it_cannot_run():
    x, w = torch.zeros(65, 32).bfloat16(), torch.zeros(40, 32).bfloat16()
    with pytest.raises(ValueError, match="1 to 64 rows"):
        lm_head_partials(x, w, None, torch.empty(65, 40))
    with pytest.raises(ValueError, match="16-bit"):
        lm_head_partials(x[:2].float(), w.float(), None, torch.empty(2, 40))


def test_bad_tiling_and_mode_are_refused(monkeypatch):
    x, w = torch.zeros(40, 32).bfloat16(), torch.zeros(64, 32).bfloat16()
    monkeypatch.setenv("LATENTSERVE_LMHEAD", "persistent")
    for bn in (8, 24):
        with pytest.raises(ValueError, match="block_n"):
            decode_linear_argmax(x, w, block_n=bn)
    monkeypatch.setenv("LATENTSERVE_LMHEAD", "Persistent")
    with pytest.raises(ValueError, match="LATENTSERVE_LMHEAD"):
        decode_linear_argmax(x, w)
