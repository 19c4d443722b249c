"""Fused residual add + RMSNorm kernel (reference: ``latentserve.ops.norm``).

Design notes: docs/internals.md, "latentserve.ops.kernels.rms_norm".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from latentserve.ops.kernels.pdl import pdl_launch, pdl_wait


@triton.jit
def _rms_norm_kernel(
    X, R, W, Out, ResOut, WPre,
    stride_xs, stride_x, stride_r, stride_o, stride_ro,
    n_cols, inv_n, eps, eps_pre,
    HAS_RESIDUAL: tl.constexpr, PRE_NORM: tl.constexpr, SPLIT: tl.constexpr,
    BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    pdl_wait(PDL)
    # R: the residual, or x itself without one; either way the activation dtype
    if SPLIT == 0:
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    else:  # fp32 partial sums [SPLIT, T, n]: their sum, rounded as the GEMM's output
        x = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            x += tl.load(X + s * stride_xs + row * stride_x + offs, mask=mask, other=0.0)
        x = x.to(R.dtype.element_ty)
    if PRE_NORM:  # x = rmsnorm(x) * w_pre first, each step rounded as the eager ops round
        pf = x.to(tl.float32)
        pre_sq = tl.sum(pf * pf, axis=0) * inv_n
        pre = (pf * tl.rsqrt(pre_sq + eps_pre)).to(R.dtype.element_ty)
        wp = tl.load(WPre + offs, mask=mask, other=0.0)
        x = (pre.to(tl.float32) * wp.to(tl.float32)).to(R.dtype.element_ty)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(R.dtype.element_ty)
        tl.store(ResOut + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    # torch's ops on CUDA: mean = sum * (1 / n), then x * rsqrt (rsqrt.approx, as rsqrtf)
    mean_sq = tl.sum(xf * xf, axis=0) * inv_n
    normed = (xf * tl.rsqrt(mean_sq + eps)).to(R.dtype.element_ty)
    w = tl.load(W + offs, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None, pre_weight: torch.Tensor | None = None,
             pre_eps: float | None = None):
    """RMSNorm of ``x`` or of ``x + residual``: x ``[T, hidden]`` (last dim contiguous) or the
    fp32 split-K partials ``[S, T, hidden]`` (then ``residual`` is required). Returns new
    ``normed`` ``[T, hidden]``, or ``(normed, x + residual)`` with ``residual``.

    ``pre_weight`` (needs ``residual``; ``pre_eps`` defaults to ``eps``): a sandwich-norm
    boundary (Ouro), ``s = residual + rms_norm(x, pre_weight, pre_eps)`` with every step
    rounded as ``ops.norm.rms_norm``; returns ``(rms_norm(s, weight, eps), s)``.
    ``pre_weight`` and x (without partials) must have the residual's dtype.

    ValueError for another shape or dtype or a strided last dim."""
    split = x.shape[0] if x.dim() == 3 else 0
    if x.dim() not in (2, 3) or x.stride(-1) != 1 or split and (
            residual is None or x.dtype != torch.float32 or not x.is_contiguous()):
        raise ValueError(f"x must be [T, hidden] with a contiguous last dim (or contiguous "
                         f"fp32 [S, T, hidden] partials with a residual), got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    if pre_weight is not None and (residual is None or pre_weight.dtype != residual.dtype
                                   or not split and x.dtype != residual.dtype):
        raise ValueError("pre_weight needs a residual, and x (without partials) and "
                         f"pre_weight of its dtype; got x {x.dtype}, pre_weight "
                         f"{pre_weight.dtype}, residual "
                         f"{None if residual is None else residual.dtype}")
    t, n = x.shape[-2:]
    act = residual.dtype if split else x.dtype
    out = torch.empty((t, n), dtype=torch.promote_types(act, weight.dtype), device=x.device)
    res_out = torch.empty((t, n), dtype=act, device=x.device) if residual is not None else out
    if t > 0:
        block = triton.next_power_of_2(n)
        r = residual if residual is not None else x
        _rms_norm_kernel[(t,)](
            x, r, weight, out, res_out, pre_weight if pre_weight is not None else weight,
            x.stride(0) if split else 0, x.stride(-2), r.stride(0), out.stride(0),
            res_out.stride(0), n, 1.0 / n, eps, eps if pre_eps is None else pre_eps,
            HAS_RESIDUAL=residual is not None, PRE_NORM=pre_weight is not None,
            SPLIT=split, BLOCK=block,
            num_warps=min(max(block // 256, 1), 8), **pdl_launch(x.device),
        )
    return out if residual is None else (out, res_out)
