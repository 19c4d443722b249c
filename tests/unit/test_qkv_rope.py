"""``ops.kernels.qkv_rope_store_kv`` (the q/k/v projection with RoPE and the KV store in its
epilogue) on CPU through the Triton interpreter, against the path it replaces: the merged
projection, then ``apply_rotary_store_kv_``. With small-integer inputs every sum is exact in
any order, so q and the pool must match bit for bit; with random inputs, within the
GEMM's summation-order noise. The engine end to end: ``tests/unit/test_decode_linear.py``;
on the H200: ``tests/gpu/test_fused_gpu.py``."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch
import torch.nn.functional as F

from latentserve.ops import kernels, rotary
from latentserve.ops.kernels.qkv_rope import qkv_rope_store_kv
from tests.support.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()

SLOTS = [7, 0, 3, 12, 0, 1, 9, 4, 15, 2, 11, 5, 6, 8, 10, 13, 14, 16, 0]  # 0: padding rows
POSITIONS = [0, 1, 5, 17, 300, 4095, 2, 9, 10, 11, 12, 40, 41, 42, 7, 8, 3, 77, 0]


def _inputs(dtype, t, heads, kv, d, hidden, integer, bias, seed):
    g = torch.Generator().manual_seed(seed)
    n = (heads + 2 * kv) * d
    if integer:  # entries in {-1, 0, 1}: every dot product is an exact small integer
        x = torch.randint(-1, 2, (t, hidden), generator=g).to(dtype)
        w = torch.randint(-1, 2, (n, hidden), generator=g).to(dtype)
        b = torch.randint(-3, 4, (n,), generator=g).to(dtype) if bias else None
    else:
        x = torch.randn(t, hidden, generator=g).to(dtype)
        w = (torch.randn(n, hidden, generator=g) / hidden**0.5).to(dtype)
        b = torch.randn(n, generator=g).to(dtype) if bias else None
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    cos, sin = rotary.rope_cos_sin(torch.tensor(POSITIONS[:t]), inv_freq, 1.0, dtype)
    caches = [torch.randn(17, kv, d, generator=g).to(dtype) for _ in range(2)]
    return x, w, b, cos, sin, caches


def _both(dtype, t, heads, kv, d, hidden, integer, bias, block_m=16, seed=0, tma=False):
    x, w, b, cos, sin, (kc, vc) = _inputs(dtype, t, heads, kv, d, hidden, integer, bias, seed)
    slots = torch.tensor(SLOTS[:t])
    qkv = F.linear(x.float(), w.float(), None if b is None else b.float()).to(dtype)
    nq, nk = heads * d, kv * d
    q_ref = qkv[:, :nq].reshape(t, heads, d).clone()
    ref_k, ref_v = kc.clone(), vc.clone()
    kernels.apply_rotary_store_kv_(q_ref, qkv[:, nq:nq + nk].view(t, kv, d),
                                   qkv[:, nq + nk:].view(t, kv, d), cos, sin, ref_k, ref_v,
                                   slots)
    k_pool, v_pool = kc.clone(), vc.clone()
    q = qkv_rope_store_kv(x, w, b, cos, sin, k_pool, v_pool, slots, heads, kv,
                          block_m=block_m, block_k=32, tma=tma)
    return (q_ref, ref_k, ref_v), (q, k_pool, v_pool)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv,d,t", [(4, 2, 64, 19), (3, 3, 96, 5), (2, 1, 128, 1)])
def test_exact_sums_match_projection_then_rotary_store_bitwise(dtype, heads, kv, d, t):
    """GQA and MHA, head dims 64/96/128, one row or more than one row tile, a bias: q and
    every pool slot but the padding slot 0 equal the unfused path bit for bit."""
    ref, got = _both(dtype, t, heads, kv, d, hidden=80, integer=True, bias=True, seed=d)
    assert got[0].shape == (t, heads, d) and got[0].dtype == dtype and got[0].is_contiguous()
    assert torch.equal(got[0], ref[0])
    for r, g in zip(ref[1:], got[1:]):
        assert torch.equal(g[1:], r[1:])


@pytest.mark.parametrize("heads,kv,d,t", [(4, 2, 64, 19), (3, 3, 96, 5)])
def test_tma_descriptor_path_bitwise(heads, kv, d, t):
    """bf16 tiles read through TMA tensor descriptors (the H200 setting; the interpreter
    emulates them): the same bits as the unfused path, head_dim 96 included (its tiles
    reach into the next half and head, columns that are computed and not stored)."""
    ref, got = _both(torch.bfloat16, t, heads, kv, d, hidden=80, integer=True, bias=True,
                     seed=d, tma=True)
    assert torch.equal(got[0], ref[0])
    for r, g in zip(ref[1:], got[1:]):
        assert torch.equal(g[1:], r[1:])


@pytest.mark.parametrize("block_m", [16, 32])
def test_random_values_within_summation_noise(block_m):
    """fp32 random inputs without a bias: equal to the unfused path within 1e-5."""
    ref, got = _both(torch.float32, 19, 4, 2, 64, hidden=200, integer=False, bias=False,
                     block_m=block_m, seed=3)
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    for r, g in zip(ref[1:], got[1:]):  # the pools, past the padding slot 0
        torch.testing.assert_close(g[1:], r[1:], rtol=1e-5, atol=1e-5)


def test_bad_arguments_name_the_problem():
    x, w, b, cos, sin, (kc, vc) = _inputs(torch.float32, 3, 2, 1, 64, 32, True, True, 0)
    slots = torch.tensor([1, 2, 3])
    good = {"x": x, "weight": w, "bias": b, "cos": cos, "sin": sin, "k_cache": kc,
            "v_cache": vc, "slots": slots, "n_heads": 2, "n_kv": 1}
    bad = [({"x": x[:, :16]}, "weight must be"), ({"n_heads": 3}, "weight rows"),
           ({"n_kv": 0}, "n_kv"), ({"x": x.double()}, "dtype"),
           ({"bias": b[:5]}, "bias"), ({"cos": cos[:2]}, "cos must"),
           ({"k_cache": kc[:, :, :32]}, "k_cache"), ({"slots": slots[:2]}, "slots"),
           ({"slots": slots.float()}, "slots"), ({"block_m": 24}, "block_m"),
           ({"block_half": 24}, "block_half"), ({"block_half": 0}, "block_half"),
           ({"block_half": 512}, "block_half"),
           ({"tma": True}, "tma=True")]
    for change, match in bad:
        with pytest.raises(ValueError, match=match):
            qkv_rope_store_kv(**{**good, **change})


@pytest.mark.parametrize("d,block_half,tma", [(64, 16, False), (64, 16, True), (96, 16, True),
                                              (128, 32, False), (80, 16, True),
                                              (96, 32, False)])
def test_heads_split_in_column_chunks_bitwise(d, block_half, tma):
    """``block_half`` below the half (several programs per head; 80 and 96 by 32: a last
    chunk reaching past the half) gives what one program per head gives, bit for bit."""
    outs = []
    for bh in (max(16, 1 << (d // 2 - 1).bit_length()), block_half):
        x, w, b, cos, sin, (kc, vc) = _inputs(torch.bfloat16, 19, 4, 2, d, 64, False, True, 7)
        slots = torch.tensor(SLOTS[:19])
        q = qkv_rope_store_kv(x, w, b, cos, sin, kc, vc, slots, 4, 2, block_m=16, block_k=32,
                              block_half=bh, tma=tma)
        outs.append((q, kc, vc))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_block_half_fills_the_grid_then_the_setting_fixes_it(monkeypatch):
    """The rule picks the fastest width of the H100 sweep (docs/benchmarks.md,
    ``benchmarks.qkv_tiling``): Ouro-1.4B (48 heads, half 64) keeps 64 columns up to 16 rows
    and takes 32 at 64 rows (96 programs); Llama-1B (48 heads, half 32) 32 then 16; SmolLM2
    (15 heads) 16; Huginn (165 heads, half 48) 64. ``LATENTSERVE_QKV_BLOCK_HALF`` fixes it."""
    from latentserve.ops.kernels.qkv_rope import default_block_half

    assert default_block_half(64) == 64  # without the grid: the half's width
    assert [default_block_half(64, 48, m, 132) for m in (1, 16, 64)] == [64, 64, 32]
    assert [default_block_half(32, 48, m, 132) for m in (1, 16, 64)] == [32, 32, 16]
    assert [default_block_half(32, 15, m, 132) for m in (1, 16, 64)] == [16, 16, 16]
    assert [default_block_half(48, 165, m, 132) for m in (1, 16, 64)] == [64, 64, 64]
    monkeypatch.setenv("LATENTSERVE_QKV_BLOCK_HALF", "64")
    assert default_block_half(64, 48, 64, 132) == 64
