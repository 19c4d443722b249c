"""The LM head of a decode batch as a persistent GEMM, with the argmax's first pass in its
epilogue.

Design notes: docs/internals.md, "latentserve.ops.kernels.lm_head".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from latentserve.ops.kernels.argmax import first_max_rows
from latentserve.ops.kernels.pdl import pdl_wait

MAX_ROWS = 64  # one row tile


@triton.jit(do_not_specialize=["M"])
def _lm_head_persistent_kernel(
    XD, WD, X, W, B, Y, AV, AI, M, N, K, stride_ym, n_tiles,
    HAS_BIAS: tl.constexpr, ROUND_TO_X: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr, NUM_PROGS: tl.constexpr, STAGES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    k_steps = tl.cdiv(K, BLOCK_K)
    pdl_wait(PDL)
    for tile in tl.range(pid, n_tiles, NUM_PROGS, flatten=True, num_stages=STAGES):
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(k_steps):  # TMA reads past K or N as zeros
            x = XD.load([0, ks * BLOCK_K]).to(W.dtype.element_ty)
            w = tl.trans(WD.load([tile * BLOCK_N, ks * BLOCK_K]))
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
        offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = offs_n < N
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ROUND_TO_X:
            acc = acc.to(X.dtype.element_ty)
        out = acc.to(Y.dtype.element_ty)
        tl.store(Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], out,
                 mask=m_ok[:, None] & n_ok[None, :])
        v, i = first_max_rows(tl.where(n_ok[None, :], out.to(tl.float32), -float("inf")),
                              tl.where(n_ok, offs_n, N), N)
        tl.store(AV + offs_m * n_tiles + tile, v, mask=m_ok)
        tl.store(AI + offs_m * n_tiles + tile, i, mask=m_ok)


def lm_head_partials(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     y: torch.Tensor, *, block_n: int = 128, block_k: int = 128,
                     num_stages: int = 4, programs: int | None = None,
                     pdl: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Write ``y = x @ weight.T + bias`` (rounded to x's dtype) and return the per-tile argmax
    results ``(vals [M, T] fp32, idx [M, T] int32)`` for ``argmax.argmax_of_chunks``.
    ``x`` ``[M <= 64, K]`` and ``weight`` ``[N, K]`` 16-bit and TMA-readable; ``programs``
    default: the SM count; ``pdl``: ``pdl.pdl_launch`` kwargs. Raises ValueError for more
    than 64 rows or tensors TMA cannot read."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from latentserve.ops.kernels.decode_linear import dot_precision, fit_stages, tma_compatible

    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    if not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x must have 1 to {MAX_ROWS} rows, got {m}")
    if not tma_compatible(x, weight):
        raise ValueError("x and weight must be 16-bit tensors of one dtype with 16-byte-aligned "
                         "bases and row strides")
    block_m = max(16, triton.next_power_of_2(m))
    n_tiles = triton.cdiv(n, block_n)
    if programs is None:
        programs = (torch.cuda.get_device_properties(x.device).multi_processor_count
                    if x.is_cuda else 4)
    programs = max(1, min(programs, n_tiles))
    stages = fit_stages(num_stages, (block_m + block_n) * block_k * x.element_size())
    vals = torch.empty(m, n_tiles, dtype=torch.float32, device=x.device)
    idx = torch.empty(m, n_tiles, dtype=torch.int32, device=x.device)
    xd = TensorDescriptor.from_tensor(x, [block_m, block_k])
    wd = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    _lm_head_persistent_kernel[(programs,)](
        xd, wd, x, weight, bias if bias is not None else weight, y, vals, idx, m, n, k,
        y.stride(0), n_tiles, HAS_BIAS=bias is not None,
        ROUND_TO_X=y.dtype.itemsize > x.dtype.itemsize, PRECISION=dot_precision(weight),
        NUM_PROGS=programs, STAGES=stages, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=4, num_stages=stages, **(pdl or {"PDL": False}))
    return vals, idx
