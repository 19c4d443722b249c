"""RoPE fused with the KV store: one launch rotates q in place and writes the rotated k and
the v of every new token into the layer's paged K/V pool (what ``ops.kernels.apply_rotary_``
followed by ``attention.kernels.store_kv`` do in two launches).

One program per token, as in both kernels it replaces: it rotates every q head in place,
rotates every k head with the same rounding (``rotary._rope_halves``: each product rounded to
the activation dtype before the sum) and stores it, cast to the pool dtype, at the token's
slot, then copies v there. k in the activations is left unrotated: the attention kernels read
the new tokens' K/V from the pool only. Results are bitwise those of the two-kernel path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from latentserve.ops.kernels.rotary import _rope_halves, _rotate_heads, check_qk_cos_sin


@triton.jit
def _rotary_store_kv_kernel(
    Q, K, V, Cos, Sin, KCache, VCache, Slots,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
    stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h,
    n_q_heads, n_k_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    c = tl.load(Cos + t * stride_ct + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    s = tl.load(Sin + t * stride_st + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    _rotate_heads(Q + t * stride_qt, stride_qh, c[None, :], s[None, :], n_q_heads,
                  HALF, BLOCK_HQ, BLOCK_HALF)

    # k and v: [BLOCK_HK, BLOCK_HALF] tiles of each half of every KV head
    offs_h = tl.arange(0, BLOCK_HK)
    mask = (offs_h < n_k_heads)[:, None] & (offs_d < HALF)[None, :]
    k_ptr = K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    k1, k2 = _rope_halves(tl.load(k_ptr, mask=mask, other=0.0),
                          tl.load(k_ptr + HALF, mask=mask, other=0.0), c[None, :], s[None, :])
    kc_ptr = KCache + slot * stride_kc_s + offs_h[:, None] * stride_kc_h + offs_d[None, :]
    tl.store(kc_ptr, k1.to(KCache.dtype.element_ty), mask=mask)
    tl.store(kc_ptr + HALF, k2.to(KCache.dtype.element_ty), mask=mask)
    v_ptr = V + t * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    vc_ptr = VCache + slot * stride_vc_s + offs_h[:, None] * stride_vc_h + offs_d[None, :]
    tl.store(vc_ptr, tl.load(v_ptr, mask=mask).to(VCache.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + HALF, tl.load(v_ptr + HALF, mask=mask).to(VCache.dtype.element_ty),
             mask=mask)


def apply_rotary_store_kv_(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Rotate q in place (rotate-half convention) and store rotated k and v into the pool.

    Afterwards q holds ``apply_rotary_``'s q and ``k_cache[slots]``/``v_cache[slots]`` hold
    what ``apply_rotary_`` then ``store_kv`` would write, bit for bit; k and v are not
    modified. No host sync and no allocation (CUDA-graph safe).

    Args:
        q: ``[T, H, D]``, k and v: ``[T, Hkv, D]``, one float dtype, last dim contiguous
            (views into a fused qkv projection are fine). D even.
        cos, sin: ``[T, D]`` (``ops.rotary.rope_cos_sin``; the first half is read), last dim
            contiguous.
        k_cache, v_cache: ``[num_slots + 1, Hkv, D]`` one layer's pool buffers (any float
            dtype; values are cast to it), last dim contiguous.
        slots: ``[T] int64`` destination slot of each token (duplicates, e.g. padded rows
            on the dummy slot 0: which write lands is unspecified).
    Raises:
        ValueError: on a shape, dtype or stride mismatch.
    """
    t, h, d = q.shape
    check_qk_cos_sin(q, k, cos, sin, d)
    hk = k.shape[1]
    if v.shape != k.shape or v.dtype != k.dtype or v.stride(-1) != 1:
        raise ValueError(f"v {tuple(v.shape)} {v.dtype} must match k {tuple(k.shape)} "
                         f"{k.dtype} with a contiguous last dim")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dim() != 3 or cache.shape[1:] != (hk, d) or cache.stride(-1) != 1:
            raise ValueError(f"{name} must be [slots, {hk}, {d}] with a contiguous last dim, "
                             f"got {tuple(cache.shape)}")
    if slots.shape != (t,):
        raise ValueError(f"slots must be [{t}], got {tuple(slots.shape)}")
    if t == 0:
        return
    half = d // 2
    _rotary_store_kv_kernel[(t,)](
        q, k, v, cos, sin, k_cache, v_cache, slots,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        h, hk,
        HALF=half, BLOCK_HQ=triton.next_power_of_2(h), BLOCK_HK=triton.next_power_of_2(hk),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4 if h * half >= 1024 else 1,
    )
