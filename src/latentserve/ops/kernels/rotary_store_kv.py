"""RoPE fused with the KV store: one launch rotates q in place and writes rotated k and v
into the layer's paged pool, bitwise what ``apply_rotary_`` (or ``apply_rotary_pairs_``) then
``store_kv`` write in two launches. k in the activations stays unrotated."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from latentserve.ops.kernels.pdl import pdl_launch, pdl_wait
from latentserve.ops.kernels.rotary import _rope_halves, _rotate_heads, check_qk_cos_sin
from latentserve.ops.kernels.rotary_pairs import (
    _bias_rope_pairs,
    _rotate_pairs,
    check_pairs_args,
)


@triton.jit
def _store_kv_tiles(k1, k2, V, KCache, VCache, t, slot, stride_vt, stride_vh,
                    stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, offs_h, offs_x, mask,
                    PARTNER: tl.constexpr):
    # Write a token's rotated k (k1 at element offs_x of each head, k2 at offs_x + PARTNER)
    # and copy its v (the same elements) into slot `slot` of the pool, cast to its dtype.
    kc = KCache + slot * stride_kc_s + offs_h[:, None] * stride_kc_h + offs_x[None, :]
    tl.store(kc, k1.to(KCache.dtype.element_ty), mask=mask)
    tl.store(kc + PARTNER, k2.to(KCache.dtype.element_ty), mask=mask)
    vp = V + t * stride_vt + offs_h[:, None] * stride_vh + offs_x[None, :]
    vc = VCache + slot * stride_vc_s + offs_h[:, None] * stride_vc_h + offs_x[None, :]
    tl.store(vc, tl.load(vp, mask=mask).to(VCache.dtype.element_ty), mask=mask)
    tl.store(vc + PARTNER, tl.load(vp + PARTNER, mask=mask).to(VCache.dtype.element_ty),
             mask=mask)


@triton.jit
def _rotary_store_kv_kernel(
    Q, K, V, Cos, Sin, KCache, VCache, Slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h,
    n_q_heads, n_k_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pdl_wait(PDL)
    slot = tl.load(Slots + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    c = tl.load(Cos + t * stride_ct + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    s = tl.load(Sin + t * stride_st + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    _rotate_heads(Q + t * stride_qt, stride_qh, c[None, :], s[None, :], n_q_heads,
                  HALF, BLOCK_HQ, BLOCK_HALF)
    offs_h = tl.arange(0, BLOCK_HK)  # k and v: [BLOCK_HK, BLOCK_HALF] tiles of each half
    mask = (offs_h < n_k_heads)[:, None] & (offs_d < HALF)[None, :]
    k_ptr = K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    k1, k2 = _rope_halves(tl.load(k_ptr, mask=mask, other=0.0),
                          tl.load(k_ptr + HALF, mask=mask, other=0.0), c[None, :], s[None, :])
    _store_kv_tiles(k1, k2, V, KCache, VCache, t, slot, stride_vt, stride_vh,
                    stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, offs_h, offs_d, mask,
                    HALF)


@triton.jit
def _rotary_pairs_store_kv_kernel(
    Q, K, V, QBias, KBias, Cos, Sin, KCache, VCache, Slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h,
    n_q_heads, n_k_heads,
    HAS_BIAS: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pdl_wait(PDL)
    slot = tl.load(Slots + t).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    c = tl.load(Cos + t * stride_ct + offs_i, mask=offs_i < HALF, other=0.0).to(tl.float32)
    s = tl.load(Sin + t * stride_st + offs_i, mask=offs_i < HALF, other=0.0).to(tl.float32)
    _rotate_pairs(Q + t * stride_qt, stride_qh, QBias, c[None, :], s[None, :], n_q_heads,
                  HAS_BIAS, HALF, BLOCK_HQ, BLOCK_HALF)
    offs_h = tl.arange(0, BLOCK_HK)  # k and v: [BLOCK_HK, BLOCK_HALF] tiles of even/odd
    mask = (offs_h < n_k_heads)[:, None] & (offs_i < HALF)[None, :]
    k_ptr = K + t * stride_kt + offs_h[:, None] * stride_kh + 2 * offs_i[None, :]
    k1, k2 = _bias_rope_pairs(tl.load(k_ptr, mask=mask, other=0.0),
                              tl.load(k_ptr + 1, mask=mask, other=0.0), KBias, offs_h, offs_i,
                              mask, c[None, :], s[None, :], HAS_BIAS, HALF)
    _store_kv_tiles(k1, k2, V, KCache, VCache, t, slot, stride_vt, stride_vh,
                    stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, offs_h, 2 * offs_i,
                    mask, 1)


def check_kv_pool(k_cache, v_cache, n_kv: int, d: int) -> None:
    """Raise ValueError naming ``k_cache`` or ``v_cache`` unless it is one layer of the KV
    pool, ``[slots, n_kv, d]`` with a contiguous last dim (the kernels that store into it)."""
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 3 or cache.shape[1:] != (n_kv, d) or cache.stride(-1) != 1:
            raise ValueError(f"{name} must be [slots, {n_kv}, {d}] with a contiguous last dim, "
                             f"got {tuple(cache.shape)}")


def _check_store_args(k, v, k_cache, v_cache, slots) -> None:
    t, hk, d = k.shape
    if v.shape != k.shape or v.dtype != k.dtype or v.stride(-1) != 1:
        raise ValueError(f"v {tuple(v.shape)} {v.dtype} must match k {tuple(k.shape)} "
                         f"{k.dtype} with a contiguous last dim")
    check_kv_pool(k_cache, v_cache, hk, d)
    if slots.shape != (t,):
        raise ValueError(f"slots must be [{t}], got {tuple(slots.shape)}")


def _strides(q, k, v, cos, sin, k_cache, v_cache):
    return (q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), sin.stride(0),
            k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
            q.shape[1], k.shape[1])


def apply_rotary_store_kv_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Rotate q in place (rotate-half) and store rotated k and v into the pool, bit for bit
    as ``apply_rotary_`` then ``store_kv``; k, v unchanged; no host sync or allocation.

    q ``[T, H, D]``, k/v ``[T, Hkv, D]`` (one float dtype, D even), cos/sin ``[T, D]``,
    k_cache/v_cache ``[num_slots + 1, Hkv, D]`` (any float dtype), slots ``[T] int64``
    (duplicate slots: which write lands is unspecified); last dims contiguous. Raises
    ValueError on a shape, dtype or stride mismatch."""
    t, h, d = q.shape
    check_qk_cos_sin(q, k, cos, sin, d)
    _check_store_args(k, v, k_cache, v_cache, slots)
    if t == 0:
        return
    half, hk = d // 2, k.shape[1]
    _rotary_store_kv_kernel[(t,)](
        q, k, v, cos, sin, k_cache, v_cache, slots,
        *_strides(q, k, v, cos, sin, k_cache, v_cache),
        HALF=half, BLOCK_HQ=triton.next_power_of_2(h), BLOCK_HK=triton.next_power_of_2(hk),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4 if h * half >= 1024 else 1, **pdl_launch(q.device),
    )


def apply_rotary_pairs_store_kv_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                 cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                                 v_cache: torch.Tensor, slots: torch.Tensor,
                                 q_bias: torch.Tensor | None = None,
                                 k_bias: torch.Tensor | None = None) -> None:
    """Huginn's convention: per-head bias add (optional) and interleaved-pair rotation, in
    place on q and stored with v into the pool, bit for bit as ``apply_rotary_pairs_`` then
    ``store_kv``. Arguments as ``apply_rotary_store_kv_`` and ``apply_rotary_pairs_`` (cos/sin
    ``[T, D/2]`` float32). Raises ValueError on a shape, dtype or stride mismatch."""
    t, h, d = q.shape
    has_bias = check_pairs_args(q, k, cos, sin, q_bias, k_bias)
    _check_store_args(k, v, k_cache, v_cache, slots)
    if t == 0:
        return
    half, hk = d // 2, k.shape[1]
    _rotary_pairs_store_kv_kernel[(t,)](
        q, k, v, q_bias if has_bias else q, k_bias if has_bias else k, cos, sin,
        k_cache, v_cache, slots,
        *_strides(q, k, v, cos, sin, k_cache, v_cache),
        HAS_BIAS=has_bias, HALF=half, BLOCK_HQ=triton.next_power_of_2(h),
        BLOCK_HK=triton.next_power_of_2(hk), BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4 if h * half >= 1024 else 1, **pdl_launch(q.device),
    )
