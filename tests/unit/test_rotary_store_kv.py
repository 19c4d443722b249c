"""The fused RoPE + KV store kernels (``ops.kernels.apply_rotary_store_kv_`` and Huginn's
``apply_rotary_pairs_store_kv_``) against the two kernels each replaces (``apply_rotary_`` or
``apply_rotary_pairs_``, then ``attention.kernels.store_kv``), on CPU through the Triton
interpreter, at tiny sizes: q and every written pool slot are bitwise equal. The real-size
comparison on CUDA is in ``tests/gpu/test_rotary_store_kv_gpu.py``;
the engine end to end in ``tests/unit/test_fused_model.py``.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch

from latentserve.attention.kernels import store_kv
from latentserve.ops import kernels, rotary
from tests.support.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Token slots: distinct, except the dummy slot 0 written twice (CUDA-graph padding rows).
SLOTS = [7, 0, 3, 12, 0, 1, 9]
POSITIONS = [0, 1, 5, 17, 300, 4095, 2]


def _inputs(dtype, heads, kv_heads, head_dim, cache_dtype, seed):
    """q, k, v as views of one fused qkv output, cos/sin, and K/V pool buffers of garbage."""
    g = torch.Generator().manual_seed(seed)
    t, num_slots = len(SLOTS), 16
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos, sin = rotary.rope_cos_sin(torch.tensor(POSITIONS), inv_freq, 1.0, dtype)
    caches = [torch.randn(num_slots + 1, kv_heads, head_dim, generator=g).to(cache_dtype)
              for _ in range(2)]
    return qkv, cos, sin, caches


def _split(qkv, heads, kv_heads, d):
    t, nq, nk = qkv.shape[0], heads * d, kv_heads * d
    return (qkv[:, :nq].view(t, heads, d), qkv[:, nq : nq + nk].view(t, kv_heads, d),
            qkv[:, nq + nk :].view(t, kv_heads, d))


def _run_both(dtype, heads, kv_heads, d, cache_dtype, seed=0):
    """(reference, fused) results: each ``(qkv, k_cache, v_cache)`` after its path ran, and
    the reference's rotated k."""
    qkv, cos, sin, (kc, vc) = _inputs(dtype, heads, kv_heads, d, cache_dtype, seed)
    slots = torch.tensor(SLOTS)
    ref = (qkv.clone(), kc.clone(), vc.clone())
    q, k, v = _split(ref[0], heads, kv_heads, d)
    kernels.apply_rotary_(q, k, cos, sin)
    store_kv(k, v, ref[1], ref[2], slots)
    fused = (qkv.clone(), kc.clone(), vc.clone())
    q, k, v = _split(fused[0], heads, kv_heads, d)
    kernels.apply_rotary_store_kv_(q, k, v, cos, sin, fused[1], fused[2], slots)
    return ref, fused, qkv


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (3, 3, 96), (4, 1, 128)])
def test_fused_kernel_equals_rotary_then_store_kv_bitwise(dtype, heads, kv_heads, head_dim):
    """GQA and MHA, head dims 64/96/128: q rotated in place and every real slot's K/V equal
    the two-kernel path bit for bit; the dummy slot 0 holds one of the rows written there;
    k and v in the activations are left as they were."""
    ref, fused, before = _run_both(dtype, heads, kv_heads, head_dim, dtype, seed=head_dim)
    _, k_rot, v = _split(ref[0], heads, kv_heads, head_dim)
    q_ref, q_fused = _split(ref[0], heads, kv_heads, head_dim)[0], \
        _split(fused[0], heads, kv_heads, head_dim)[0]
    assert torch.equal(q_fused, q_ref)
    nq = heads * head_dim
    assert torch.equal(fused[0][:, nq:], before[:, nq:])  # k unrotated, v untouched
    for ref_cache, fused_cache, new in ((ref[1], fused[1], k_rot), (ref[2], fused[2], v)):
        assert torch.equal(fused_cache[1:], ref_cache[1:])  # untouched slots included
        dummies = [i for i, s in enumerate(SLOTS) if s == 0]
        assert any(torch.equal(fused_cache[0], new[i]) for i in dummies)


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.bfloat16),
                                               (torch.bfloat16, torch.float32),
                                               (torch.float16, torch.bfloat16)])
def test_fused_kernel_casts_to_the_pool_dtype_as_store_kv(dtype, cache_dtype):
    """The rotated k is rounded to the activation dtype first, then cast to the pool's."""
    ref, fused, _ = _run_both(dtype, 4, 2, 64, cache_dtype, seed=5)
    assert fused[1].dtype == cache_dtype
    assert torch.equal(fused[1][1:], ref[1][1:]) and torch.equal(fused[2][1:], ref[2][1:])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 64), (3, 3, 96), (4, 1, 128)])
@pytest.mark.parametrize("bias", [True, False])
def test_pairs_kernel_equals_rotary_pairs_then_store_kv_bitwise(dtype, heads, kv_heads,
                                                                head_dim, bias):
    """Huginn's convention (qk_bias add, interleaved pairs rotated in fp32)."""
    qkv, _, _, (kc, vc) = _inputs(dtype, heads, kv_heads, head_dim, dtype, seed=head_dim)
    g = torch.Generator().manual_seed(1)
    freqs = torch.tensor(POSITIONS).float()[:, None] * torch.rand(head_dim // 2, generator=g)
    cos, sin = freqs.cos(), freqs.sin()
    qb, kb = (None, None)
    if bias:
        qb = (0.5 * torch.randn(heads, head_dim, generator=g)).to(dtype)
        kb = (0.5 * torch.randn(kv_heads, head_dim, generator=g)).to(dtype)
    slots = torch.tensor(SLOTS)
    ref = (qkv.clone(), kc.clone(), vc.clone())
    q, k, v = _split(ref[0], heads, kv_heads, head_dim)
    kernels.apply_rotary_pairs_(q, k, cos, sin, qb, kb)
    store_kv(k, v, ref[1], ref[2], slots)
    fused = (qkv.clone(), kc.clone(), vc.clone())
    q, k, v = _split(fused[0], heads, kv_heads, head_dim)
    kernels.apply_rotary_pairs_store_kv_(q, k, v, cos, sin, fused[1], fused[2], slots, qb, kb)
    nq = heads * head_dim
    assert torch.equal(fused[0][:, :nq], ref[0][:, :nq])
    assert torch.equal(fused[0][:, nq:], qkv[:, nq:])  # k unrotated, v untouched
    assert torch.equal(fused[1][1:], ref[1][1:]) and torch.equal(fused[2][1:], ref[2][1:])


def test_fused_kernel_rejects_bad_layouts():
    t, d = 3, 8
    q, k, v = torch.randn(t, 2, d), torch.randn(t, 1, d), torch.randn(t, 1, d)
    cos, sin = torch.ones(t, d), torch.zeros(t, d)
    cache, slots = torch.zeros(5, 1, d), torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="v .* must match k"):
        kernels.apply_rotary_store_kv_(q, k, torch.randn(t, 2, d), cos, sin, cache, cache,
                                       slots)
    with pytest.raises(ValueError, match="k_cache must be"):
        kernels.apply_rotary_store_kv_(q, k, v, cos, sin, torch.zeros(5, 2, d), cache, slots)
    with pytest.raises(ValueError, match="slots must be"):
        kernels.apply_rotary_store_kv_(q, k, v, cos, sin, cache, cache, slots[:2])
    with pytest.raises(ValueError, match="both q_bias and k_bias"):
        kernels.apply_rotary_pairs_store_kv_(q, k, v, cos[:, :4], sin[:, :4], cache, cache,
                                             slots, torch.zeros(2, d), None)
