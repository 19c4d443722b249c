"""KV store kernel: ``k_cache[slots] = k.to(k_cache.dtype)`` (and V), one program per token,
for the Triton backend's callers whose RoPE does not store K/V itself."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(
    K, V, KCache, VCache, Slots,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < NUM_KV_HEADS)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(KCache + slot * stride_kc_s + offs_h[:, None] * stride_kc_h + offs_d[None, :],
             k.to(KCache.dtype.element_ty), mask=mask)
    tl.store(VCache + slot * stride_vc_s + offs_h[:, None] * stride_vc_h + offs_d[None, :],
             v.to(VCache.dtype.element_ty), mask=mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """Write new K/V ``[T, num_kv_heads, head_dim]`` into the pool ``[num_slots + 1, ...]``
    at ``slots`` (``[T] int64``; duplicates: which write lands is unspecified), in place."""
    t, h, d = k.shape
    if t == 0:
        return
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _store_kv_kernel[(t,)](
        k, v, k_cache, v_cache, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        NUM_KV_HEADS=h, HEAD_DIM=d,
        BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d),
        num_warps=1 if h * d <= 512 else 4,
    )
