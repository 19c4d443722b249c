"""Huginn's RoPE kernel: optional per-head bias add, then rotation of interleaved pairs, q and
k in place in one launch; bitwise as ``latent.huginn.rope_pairs`` after the ``qk_bias`` add.
Source: ``apply_rotary_emb_complex_like`` in seal-rg/recurrent-pretraining
``recpre/raven_modeling_minimal.py`` (fp32 rotation, bias added in the activation dtype)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from latentserve.ops.kernels.rotary import check_qk_cos_sin


@triton.jit
def _bias_rope_pairs(a, b, bias, offs_h, offs_i, mask, c, s, HAS_BIAS: tl.constexpr,
                     HALF: tl.constexpr):
    # The even (a) and odd (b) elements of [heads, HALF] tiles, biased and rotated, in their
    # activation dtype (c, s: fp32).
    dt = a.dtype
    if HAS_BIAS:  # bias [heads, 2 * HALF] contiguous, same dtype; eager: (x + bias) in dt
        bptr = bias + offs_h[:, None] * (2 * HALF) + 2 * offs_i[None, :]
        a = (a.to(tl.float32) + tl.load(bptr, mask=mask, other=0.0).to(tl.float32)).to(dt)
        b = (b.to(tl.float32) + tl.load(bptr + 1, mask=mask, other=0.0).to(tl.float32)).to(dt)
    a, b = a.to(tl.float32), b.to(tl.float32)
    return (a * c - b * s).to(dt), (b * c + a * s).to(dt)


@triton.jit
def _rotate_pairs(base, stride_h, bias, c, s, n_heads, HAS_BIAS: tl.constexpr,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_i = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < n_heads)[:, None] & (offs_i < HALF)[None, :]
    ptr = base + offs_h[:, None] * stride_h + 2 * offs_i[None, :]
    a, b = _bias_rope_pairs(tl.load(ptr, mask=mask, other=0.0),
                            tl.load(ptr + 1, mask=mask, other=0.0), bias, offs_h, offs_i, mask,
                            c, s, HAS_BIAS, HALF)
    tl.store(ptr, a, mask=mask)
    tl.store(ptr + 1, b, mask=mask)


@triton.jit
def _rotary_pairs_kernel(
    Q, K, QBias, KBias, Cos, Sin,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    n_q_heads, n_k_heads,
    HAS_BIAS: tl.constexpr, HALF: tl.constexpr, BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_i = tl.arange(0, BLOCK_HALF)
    c = tl.load(Cos + t * stride_ct + offs_i, mask=offs_i < HALF, other=0.0).to(tl.float32)
    s = tl.load(Sin + t * stride_st + offs_i, mask=offs_i < HALF, other=0.0).to(tl.float32)
    _rotate_pairs(Q + t * stride_qt, stride_qh, QBias, c[None, :], s[None, :], n_q_heads,
                  HAS_BIAS, HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_pairs(K + t * stride_kt, stride_kh, KBias, c[None, :], s[None, :], n_k_heads,
                  HAS_BIAS, HALF, BLOCK_HK, BLOCK_HALF)


def check_pairs_args(q, k, cos, sin, q_bias, k_bias) -> bool:
    """The argument checks of the pair-RoPE kernels (see ``apply_rotary_pairs_``); returns
    whether a bias is given. Raises ValueError naming the mismatch."""
    h, d = q.shape[1], q.shape[2]
    check_qk_cos_sin(q, k, cos, sin, d // 2)
    has_bias = q_bias is not None
    if has_bias != (k_bias is not None):
        raise ValueError("pass both q_bias and k_bias, or neither")
    if has_bias and (q_bias.shape != (h, d) or k_bias.shape != (k.shape[1], d)
                     or q_bias.dtype != q.dtype or k_bias.dtype != q.dtype
                     or not q_bias.is_contiguous() or not k_bias.is_contiguous()):
        raise ValueError(f"q_bias/k_bias must be contiguous [{h}, {d}] / [{k.shape[1]}, {d}] "
                         f"in {q.dtype}")
    return has_bias


def apply_rotary_pairs_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor, q_bias: torch.Tensor | None = None,
                        k_bias: torch.Tensor | None = None) -> None:
    """Add the per-head bias (optional) and rotate interleaved pairs of q and k in place.
    q ``[T, H, D]``, k ``[T, Hk, D]`` (same float dtype, D even), cos/sin ``[T, D/2]``
    float32, q_bias/k_bias ``[H, D]`` / ``[Hk, D]`` in q's dtype (both or neither); last dims
    contiguous. Raises ValueError on a shape, dtype or stride mismatch."""
    t, h, d = q.shape
    half = d // 2
    has_bias = check_pairs_args(q, k, cos, sin, q_bias, k_bias)
    if t == 0:
        return
    _rotary_pairs_kernel[(t,)](
        q, k, q_bias if has_bias else q, k_bias if has_bias else k, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        h, k.shape[1],
        HAS_BIAS=has_bias, HALF=half, BLOCK_HQ=triton.next_power_of_2(h),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]), BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4 if h * half >= 1024 else 1,
    )
