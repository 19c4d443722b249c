"""Fused residual add + RMSNorm kernel (reference: ``latentserve.ops.norm``).

One program per row holds the whole row in registers (hidden sizes up to a few thousand),
so the add, the fp32 sum of squares and the scaling read and write each element once.
Same rounding as ``ops.norm.add_rms_norm``: the sum is rounded to the input dtype (it is
the new residual), normalized in fp32, rounded again, then multiplied by the weight.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    X, R, W, Out, ResOut,
    stride_x, stride_r, stride_o, stride_ro,
    n_cols, inv_n, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(ResOut + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    # torch's ops on CUDA: mean = sum * (1 / n), then x * rsqrt (rsqrt.approx, as rsqrtf)
    mean_sq = tl.sum(xf * xf, axis=0) * inv_n
    normed = (xf * tl.rsqrt(mean_sq + eps)).to(X.dtype.element_ty)
    w = tl.load(W + offs, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(Out + row * stride_o + offs, y.to(Out.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None):
    """RMSNorm of ``x`` (``residual`` None) or of ``x + residual``.

    Args:
        x: ``[T, hidden]`` fp32/bf16/fp16 (rows may be strided; last dim contiguous).
        weight: ``[hidden]``. eps: added to the mean square.
        residual: optional ``[T, hidden]`` in x's dtype.
    Returns:
        ``normed`` ``[T, hidden]`` (dtype: promotion of x and weight) when ``residual`` is
        None, else ``(normed, x + residual)``: new tensors, the inputs are not modified.
    Raises:
        ValueError: when x is not 2-D or its last dim is not contiguous.
    """
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, hidden] with a contiguous last dim, got shape "
                         f"{tuple(x.shape)} strides {x.stride()}")
    t, n = x.shape
    out = torch.empty((t, n), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    res_out = torch.empty_like(x) if residual is not None else out
    if t > 0:
        block = triton.next_power_of_2(n)
        r = residual if residual is not None else x
        _rms_norm_kernel[(t,)](
            x, r, weight, out, res_out,
            x.stride(0), r.stride(0), out.stride(0), res_out.stride(0),
            n, 1.0 / n, eps,
            HAS_RESIDUAL=residual is not None, BLOCK=block,
            num_warps=min(max(block // 256, 1), 8),
        )
    return out if residual is None else (out, res_out)
