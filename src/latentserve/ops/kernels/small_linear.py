"""Float32 linear layer for a few dozen rows on tensor cores, with bias and SiLU fused.

The compression head's serve path (``latent/head.py``) runs nine float32 Linears on the
64 or so rows of a decode batch. cuBLAS runs float32 GEMMs of that size as SIMT kernels
with few thread blocks: on the H200 the Llama-1B-shaped head took 214 us per step that way
(docs/benchmarks.md), against ~8 us to read its weights. This kernel tiles the output
columns finely (one program per 16 columns and up to 64 rows, so even a 1024-wide layer
gets 64 programs) and multiplies on tensor cores with Triton's ``tf32x3`` input precision:
each float32 operand is split into a TF32 high part and a TF32 remainder and three TF32
products are summed in float32 (the "3xTF32" scheme of CUTLASS), which keeps about 21 bits
of each operand, so results stay within float32 rounding noise of an IEEE GEMM (about 1e-6
relative), unlike plain TF32 (about 1e-3).

Under ``TRITON_INTERPRET=1`` (CPU tests) ``tl.dot`` is an ordinary float32 product.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_ACTS = {None: 0, "silu": 1}


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


def small_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 activation: str | None = None, out_features: int | None = None,
                 precision: str = "tf32x3") -> torch.Tensor:
    """``act(x @ weight[:n].T + bias[:n])`` in float32, for a small number of rows.

    Args:
        x: ``[M, K]`` float32, last dim contiguous (M up to a few hundred; rows are tiled
            64 at a time, so larger M works but is not what the tiling is for).
        weight: ``[N, K]`` float32, last dim contiguous (``nn.Linear.weight``).
        bias: ``[N]`` float32 or None.
        activation: None or ``"silu"`` (applied after the bias, in float32).
        out_features: compute only the first ``n`` output features (rows of ``weight``;
            default all ``N``), e.g. the ``mu`` half of a head whose second half is
            ``log_sigma``.
        precision: ``tl.dot`` input precision: ``"tf32x3"`` (default, float32-accurate),
            ``"ieee"`` (SIMT float32) or ``"tf32"`` (fast, about 1e-3 relative).
    Returns:
        ``[M, n]`` float32, a new contiguous tensor.
    Raises:
        ValueError: on a dtype, shape or stride mismatch or an unknown activation.
    """
    if activation not in _ACTS:
        raise ValueError(f"activation must be one of {list(_ACTS)}, got {activation!r}")
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] must share K, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or (
            bias is not None and bias.dtype != torch.float32):
        raise ValueError("small_linear takes float32 x, weight and bias")
    if x.stride(-1) != 1 or weight.stride(-1) != 1 or (bias is not None
                                                         and bias.stride(-1) != 1):
        raise ValueError("x, weight and bias need a contiguous last dim")
    n = weight.shape[0] if out_features is None else out_features
    if not 0 < n <= weight.shape[0]:
        raise ValueError(f"out_features must be in [1, {weight.shape[0]}], got {n}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    m, k = x.shape
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0:
        return y
    block_m = min(64, max(16, triton.next_power_of_2(m)))
    block_n, block_k = 16, 64
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _small_linear_kernel[grid](
        x, weight, bias if bias is not None else weight, y, m, n, k,
        x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, ACT=_ACTS[activation], PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4, num_stages=4,
    )
    return y
