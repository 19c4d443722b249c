"""RoPE kernel: rotates q and k in place in one launch, bitwise as ``latentserve.ops.rotary``
(each product rounded to the activation dtype before the sum)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_halves(x1, x2, c, s):
    # Both rotated halves, in the activation dtype of x1/x2 (c, s: fp32). Eager:
    # q * cos + rotate_half(q) * sin, every product rounded to the activation dtype.
    dt = x1.dtype
    x1, x2 = x1.to(tl.float32), x2.to(tl.float32)
    out1 = (x1 * c).to(dt).to(tl.float32) + (-x2 * s).to(dt).to(tl.float32)
    out2 = (x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)
    return out1.to(dt), out2.to(dt)


@triton.jit
def _rotate_heads(base, stride_h, c, s, n_heads, HALF: tl.constexpr, BLOCK_H: tl.constexpr,
                  BLOCK_HALF: tl.constexpr):
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < n_heads)[:, None] & (offs_d < HALF)[None, :]
    ptr = base + offs_h[:, None] * stride_h + offs_d[None, :]
    out1, out2 = _rope_halves(tl.load(ptr, mask=mask, other=0.0),
                              tl.load(ptr + HALF, mask=mask, other=0.0), c, s)
    tl.store(ptr, out1, mask=mask)
    tl.store(ptr + HALF, out2, mask=mask)


@triton.jit
def _rotary_kernel(
    Q, K, Cos, Sin,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_ct, stride_st,
    n_q_heads, n_k_heads,
    HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    c = tl.load(Cos + t * stride_ct + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    s = tl.load(Sin + t * stride_st + offs_d, mask=offs_d < HALF, other=0.0).to(tl.float32)
    _rotate_heads(Q + t * stride_qt, stride_qh, c[None, :], s[None, :], n_q_heads,
                  HALF, BLOCK_HQ, BLOCK_HALF)
    _rotate_heads(K + t * stride_kt, stride_kh, c[None, :], s[None, :], n_k_heads,
                  HALF, BLOCK_HK, BLOCK_HALF)


def check_qk_cos_sin(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     cos_dim: int) -> None:
    """The shared argument checks of the RoPE kernels: q ``[T, H, D]`` and k ``[T, Hk, D]``
    of one dtype with D even, cos/sin ``[T, cos_dim]``, every last dim contiguous.
    Raises ValueError naming the mismatch."""
    t, _, d = q.shape
    if k.shape[0] != t or k.shape[2] != d or k.dtype != q.dtype or d % 2:
        raise ValueError(f"q {tuple(q.shape)} {q.dtype} and k {tuple(k.shape)} {k.dtype} must "
                         "share T, an even head_dim and the dtype")
    if cos.shape != (t, cos_dim) or sin.shape != (t, cos_dim):
        raise ValueError(f"cos/sin must be [{t}, {cos_dim}], got {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")
    if any(x.stride(-1) != 1 for x in (q, k, cos, sin)):
        raise ValueError("q, k, cos and sin need a contiguous last dim")


def apply_rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> None:
    """Rotate q ``[T, H, D]`` and k ``[T, Hkv, D]`` (same float dtype, D even) in place,
    rotate-half; cos/sin ``[T, D]`` (``ops.rotary.rope_cos_sin``, first half read); last
    dims contiguous. Raises ValueError on a shape, dtype or stride mismatch."""
    t, h, d = q.shape
    check_qk_cos_sin(q, k, cos, sin, d)
    if t == 0:
        return
    half = d // 2
    _rotary_kernel[(t,)](
        q, k, cos, sin,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0), sin.stride(0),
        h, k.shape[1],
        HALF=half, BLOCK_HQ=triton.next_power_of_2(h),
        BLOCK_HK=triton.next_power_of_2(k.shape[1]), BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4 if h * half >= 1024 else 1,
    )
