"""Float32 linear layer for a few dozen rows on tensor cores, with bias and SiLU fused.

Design notes: docs/internals.md, "latentserve.ops.kernels.small_linear".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ACTS = {None: 0, "silu": 1}
_PRECISIONS = ("tf32x3", "ieee", "tf32")


@triton.jit
def _small_linear_kernel(
    X, W, B, Y, M, N, K,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        k_ok = k < K
        x = tl.load(X + offs_m[:, None].to(tl.int64) * stride_xm + k[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        # W is [N, K] row-major (nn.Linear); the tile is read as its transpose [BK, BN].
        w = tl.load(W + offs_n[None, :].to(tl.int64) * stride_wn + k[:, None],
                    mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(B + offs_n, mask=n_ok, other=0.0)[None, :]
    if ACT == 1:  # SiLU
        acc = acc * tl.sigmoid(acc)
    tl.store(Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], acc,
             mask=m_ok[:, None] & n_ok[None, :])


_TUNE_CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=4, num_stages=st)
                 for bn, bk, st in ((16, 64, 4), (16, 128, 3), (32, 64, 4), (32, 128, 3),
                                    (16, 256, 2), (64, 64, 3))]


def _quick_bench(kernel_call, quantiles):
    return triton.testing.do_bench(kernel_call, warmup=2, rep=8, quantiles=quantiles)


_tuned_kernel = triton.autotune(_TUNE_CONFIGS, key=["N", "K", "BLOCK_M"],
                                do_bench=_quick_bench)(_small_linear_kernel)


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation: str | None = None, out_features: int | None = None,
                 precision: str = "tf32x3", tuned: bool | None = None) -> torch.Tensor:
    """``act(x @ weight[:n].T + bias[:n])`` in float32 for a few rows (tiled 64 at a time).

    ``x`` ``[M, K]``, ``weight`` ``[N, K]``, ``bias`` ``[N]`` or None, all float32, last dims
    contiguous; ``activation`` None or ``"silu"``; ``out_features``: the first ``n`` outputs
    (default N); ``precision``: ``"tf32x3"`` (default, float32-accurate), ``"ieee"`` or
    ``"tf32"`` (~1e-3 relative); ``tuned`` None = autotune on CUDA. Returns a new ``[M, n]``
    float32. Raises ValueError on a dtype, device, shape or stride mismatch, an unknown
    activation or precision, or a bad ``out_features``."""
    if activation not in _ACTS:
        raise ValueError(f"activation must be one of {list(_ACTS)}, got {activation!r}")
    if precision not in _PRECISIONS:
        raise ValueError(f"precision must be one of {list(_PRECISIONS)}, got {precision!r}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] must share K, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or (
            bias is not None and bias.dtype != torch.float32):
        raise ValueError("small_linear takes float32 x, weight and bias")
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or (bias is not None
                                                         and bias.stride(-1) != 1):
        raise ValueError("x, weight and bias need a contiguous last dim")
    if any(t is not None and t.device != x.device for t in (weight, bias)):
        raise ValueError(f"x, weight and bias must be on one device, got x on {x.device}, "
                         f"weight on {weight.device}"
                         + ("" if bias is None else f", bias on {bias.device}"))
    n = weight.shape[0] if out_features is None else out_features
    if isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= weight.shape[0]:
        raise ValueError(f"out_features must be an integer in [1, {weight.shape[0]}], got {n!r}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0:
        return y
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    args = (x, weight, bias if bias is not None else weight, y, m, n, k,
            x.stride(0), weight.stride(0), y.stride(0))
    flags = {"HAS_BIAS": bias is not None, "ACT": _ACTS[activation], "PRECISION": precision,
             "BLOCK_M": block_m}
    if x.is_cuda if tuned is None else tuned:
        def grid(meta):
            return triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(m, block_m)

        _tuned_kernel[grid](*args, **flags)
    else:
        _small_linear_kernel[(triton.cdiv(n, 16), triton.cdiv(m, block_m))](
            *args, **flags, BLOCK_N=16, BLOCK_K=64, num_warps=4, num_stages=4)
    return y
