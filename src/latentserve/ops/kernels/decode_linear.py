"""Linear layer for decode-sized batches (up to a few dozen rows) with split-K, fused SiLU and
SiLU-and-multiply epilogues and programmatic dependent launch.

Design notes: docs/internals.md, "latentserve.ops.kernels.decode_linear".
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from latentserve import settings
from latentserve.ops.kernels.argmax import argmax_of_chunks, first_max_rows
from latentserve.ops.kernels.pdl import pdl_launch, pdl_wait, sm90_or_newer
from latentserve.ops.kernels.silu_and_mul import silu_mul


@triton.jit(do_not_specialize=["M"])  # one compile serves every row count of a row tile
def _decode_linear_kernel(
    X, W, XD, WD, B, Y, P, AV, AI,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, SWIGLU: tl.constexpr, PARTIALS: tl.constexpr,
    ROUND_TO_X: tl.constexpr, ARGMAX: tl.constexpr, PRECISION: tl.constexpr,
    PDL: tl.constexpr, TMA: tl.constexpr, SILU: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # XD, WD: TMA descriptors of x and the weight when TMA (tiles past an edge read as
    # zeros), else unused; X and W give the dtypes and, without TMA, the addresses.
    # AV, AI: with ARGMAX (no K split), [M, column tiles] fp32 / int32 for each row's
    # first maximum in this program's columns (argmax pass 1), else unused.
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_ok = offs_n < N
    m_ok = offs_m < M
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    pdl_wait(PDL)
    x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
    w_cols = W + offs_n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SWIGLU:  # the up rows sit N rows below the gate rows
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_per_split, BLOCK_K):
        if TMA:  # splits are BLOCK_K-aligned, so a tile never crosses into the next split
            x = XD.load([pid_m * BLOCK_M, k_lo + k0]).to(W.dtype.element_ty)
            w = tl.trans(WD.load([pid_n * BLOCK_N, k_lo + k0]))
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
            if SWIGLU:
                w_up = tl.trans(WD.load([N + pid_n * BLOCK_N, k_lo + k0]))
                acc_up = tl.dot(x, w_up, acc_up, input_precision=PRECISION)
        else:
            k = k_lo + k0 + offs_k
            k_ok = k < k_hi
            x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            x = x.to(W.dtype.element_ty)
            # W is [N, K] row-major (nn.Linear); the tile is read as its transpose [BK, BN].
            w_mask = k_ok[:, None] & n_ok[None, :]
            w = tl.load(w_cols + k[:, None], mask=w_mask, other=0.0)
            acc = tl.dot(x, w, acc, input_precision=PRECISION)
            if SWIGLU:
                w_up = tl.load(w_cols + N * stride_wn + k[:, None], mask=w_mask, other=0.0)
                acc_up = tl.dot(x, w_up, acc_up, input_precision=PRECISION)
    if SWIGLU:  # silu(gate) * up, rounded where silu_and_mul rounds (after the GEMM's rounding)
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            acc_up += tl.load(B + N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc = silu_mul(acc.to(Y.dtype.element_ty), acc_up.to(Y.dtype.element_ty))
    mask = m_ok[:, None] & n_ok[None, :]
    if PARTIALS:  # fp32 partial sums P [SPLIT_K, M, N]; the consumer adds the bias
        tl.store(P + (pid_k * M + offs_m[:, None]).to(tl.int64) * N + offs_n[None, :], acc,
                 mask=mask)
    else:
        if HAS_BIAS and not SWIGLU:
            acc += tl.load(B + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if SILU:
            acc = acc * tl.sigmoid(acc)
        if ROUND_TO_X:
            acc = acc.to(X.dtype.element_ty)
        out = acc.to(Y.dtype.element_ty)
        tl.store(Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], out,
                 mask=mask)
        if ARGMAX:  # of the values just stored; columns past N hold -inf and index N
            v, i = first_max_rows(tl.where(n_ok[None, :], out.to(tl.float32), -float("inf")),
                                  tl.where(n_ok, offs_n, N), N)
            n_tiles = tl.num_programs(0)
            tl.store(AV + offs_m * n_tiles + pid_n, v, mask=m_ok)
            tl.store(AI + offs_m * n_tiles + pid_n, i, mask=m_ok)


@triton.jit(do_not_specialize=["M"])
def _split_k_reduce_kernel(
    P, B, Y, XT, M, N, stride_ym,
    HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, ROUND_TO_X: tl.constexpr,
    PDL: tl.constexpr, SILU: tl.constexpr, BLOCK: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(P + (s * M + m) * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(B + offs, mask=ok, other=0.0).to(tl.float32)
    if SILU:
        acc = acc * tl.sigmoid(acc)
    if ROUND_TO_X:  # XT: any tensor of x's dtype
        acc = acc.to(XT.dtype.element_ty)
    tl.store(Y + m * stride_ym + offs, acc.to(Y.dtype.element_ty), mask=ok)


def pick_tiling(m: int, n: int, k: int, num_sms: int = 132,
                in_l2: bool = False) -> tuple[int, int, int]:
    """``(BLOCK_N, BLOCK_K, SPLIT_K)`` for an ``[m, k] @ [k, n]`` decode GEMM: 128 columns a
    program for a wide weight, else 64; the fewest power-of-2 K splits (>= 512 long) giving
    >= 0.7 programs per SM (0.35 with ``in_l2``). Source: ``benchmarks.layer_gpu`` H200 sweeps."""
    block_n = 128 if n >= 8192 else 64
    tiles = triton.cdiv(n, block_n) * triton.cdiv(m, 64)
    split, target = 1, num_sms * (0.35 if in_l2 else 0.7)
    while tiles * split < target and k // (2 * split) >= 512:
        split *= 2
    return block_n, 128, split


def use_tma(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether tiles are read through TMA descriptors by default: compute capability >= 9.0
    (not the interpreter), 16-bit weights of x's dtype, 16-byte-aligned bases and row
    strides. ``LATENTSERVE_DECODE_TMA=0`` / ``=1`` forces it off / on."""
    env = settings.get("LATENTSERVE_DECODE_TMA")
    if env == "0":
        return False
    if env != "1" and not (x.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"
                           and _device_has_tma(x.device.index)):
        return False
    return tma_compatible(x, weight)


def tma_compatible(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether TMA descriptors can read ``x`` and ``weight`` (2-D, last dim contiguous):
    16-bit tensors of one dtype with 16-byte-aligned bases and row strides."""
    if weight.element_size() != 2 or x.dtype != weight.dtype:
        return False
    return all(t.data_ptr() % 16 == 0 and t.stride(0) * t.element_size() % 16 == 0
               for t in (x, weight))


_device_has_tma = sm90_or_newer  # TMA came with sm_90, as PDL did


def dot_precision(weight: torch.Tensor) -> str | None:
    """``tl.dot``'s ``input_precision`` for a decode GEMM with ``weight``: fp32 weights take
    3xTF32 on CUDA (fp32 accuracy on tensor cores) and exact products in the interpreter;
    16-bit weights the default (None)."""
    if weight.dtype != torch.float32:
        return None
    return "tf32x3" if weight.is_cuda else "ieee"


def fit_stages(num_stages: int, stage_bytes: int) -> int:
    """``num_stages`` lowered so Triton's pipeline buffers (``stage_bytes`` of x and weight
    tiles per stage) stay under ~200 KiB of shared memory; at least 1."""
    return max(1, min(num_stages, 200 * 1024 // stage_bytes))


def _check(x, weight, bias, swiglu):
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [M, K] and weight [N, K] must share K, got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    if swiglu and weight.shape[0] % 2:
        raise ValueError(f"swiglu needs a merged gate/up weight [2I, K], got "
                         f"{tuple(weight.shape)}")
    if x.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("x and weight need a contiguous last dim")
    if x.dtype != weight.dtype:
        raise ValueError(f"x and weight must share a dtype, got {x.dtype} and {weight.dtype}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if any(t is not None and t.device != x.device for t in (weight, bias)):
        raise ValueError("x, weight and bias must be on one device")


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  *, swiglu: bool = False, silu: bool = False, partials: bool = False,
                  out_dtype: torch.dtype | None = None, block_n: int | None = None,
                  block_k: int | None = None, split_k: int | None = None,
                  num_stages: int = 4, tma: bool | None = None,
                  weight_in_l2: bool = False) -> torch.Tensor:
    """``x @ weight.T + bias`` for a few rows; with ``silu``, ``silu`` of it; with ``swiglu``,
    ``silu(gate) * up`` of the merged gate/up projection (gate: the first half of columns).

    ``x`` ``[M, K]`` bf16/fp16/fp32, ``weight`` ``[N, K]``, ``bias`` ``[N]``, last dims
    contiguous; fp32 weights multiply as 3xTF32 on CUDA (``dot_precision``). ``partials``: the
    fp32 K-split partial sums ``[S, M, N]`` instead (caller adds the bias; not with ``swiglu``
    or ``silu``). ``out_dtype`` (default x's): a wider one holds values
    rounded to x's dtype. Tiling defaults to ``pick_tiling``; ``tma`` to ``use_tma``;
    ``weight_in_l2`` splits K less. Returns new ``[M, N]`` (``[M, N / 2]`` with ``swiglu``).
    Raises ValueError on a shape, stride or device mismatch or a bad tiling."""
    return _launch(x, weight, bias, swiglu, partials, out_dtype, block_n, block_k, split_k,
                   num_stages, tma, weight_in_l2, argmax=False, silu=silu)[0]


def decode_linear_argmax(x: torch.Tensor, weight: torch.Tensor,
                         bias: torch.Tensor | None = None, *,
                         out_dtype: torch.dtype | None = None, block_n: int | None = None,
                         block_k: int | None = None, num_stages: int = 4,
                         tma: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The LM head and greedy argmax together: ``decode_linear(x, weight, bias)`` (no K split)
    whose epilogue writes each tile's first maximum, then a PDL kernel picks each row's
    (``argmax.argmax_of_chunks``). Returns ``(y [M, N], ids [M] int64)``, ``ids`` equal to
    ``torch.argmax(y, -1)`` bit for bit. Raises ValueError as ``decode_linear``."""
    _check(x, weight, bias, False)
    for name, val in (("block_n", block_n), ("block_k", block_k)):
        if val is not None and (val < 16 or val & (val - 1)):
            raise ValueError(f"bad tiling {name}={val}: a power of 2 >= 16")
    if (persistent_lm_head(x.shape[0]) and 0 < x.shape[0] <= 64
            and (use_tma(x, weight) if tma is None else tma and tma_compatible(x, weight))):
        from latentserve.ops.kernels.lm_head import lm_head_partials

        y = torch.empty(x.shape[0], weight.shape[0], dtype=out_dtype or x.dtype,
                        device=x.device)
        vals, idx = lm_head_partials(x, weight, bias, y, block_n=block_n or 128,
                                     block_k=block_k or 128, num_stages=num_stages,
                                     pdl=pdl_launch(x.device))
        return y, argmax_of_chunks(vals, idx, weight.shape[0])
    y, vals, idx = _launch(x, weight, bias, False, False, out_dtype, block_n, block_k, 1,
                           num_stages, tma, False, argmax=True)
    if vals is None:  # no rows
        return y, torch.empty(0, dtype=torch.int64, device=x.device)
    return y, argmax_of_chunks(vals, idx, weight.shape[0])


def persistent_lm_head(rows: int) -> bool:
    """Whether ``decode_linear_argmax`` runs the persistent LM head (``ops.kernels.lm_head``;
    needs TMA, <= 64 rows) for ``rows``: from 33 rows on. ``LATENTSERVE_LMHEAD=persistent`` /
    ``=tiled`` forces either (default ``auto``). Raises ValueError for another value."""
    mode = settings.get("LATENTSERVE_LMHEAD")
    return mode == "persistent" or (mode == "auto" and rows > 32)


def _launch(x, weight, bias, swiglu, partials, out_dtype, block_n, block_k, split_k,
            num_stages, tma, weight_in_l2, argmax, silu=False):
    """decode_linear's launch; returns ``(y, vals, idx)``, the last two the argmax pass-1
    buffers with ``argmax`` (None without, or for no rows)."""
    _check(x, weight, bias, swiglu)
    if partials and (swiglu or silu) or swiglu and silu:
        raise ValueError("swiglu, silu and partials cannot be combined")
    m, n, k = x.shape[0], weight.shape[0], weight.shape[1]
    bn, bk, sk = pick_tiling(m, n, k, in_l2=weight_in_l2)
    if swiglu:  # one program computes BLOCK_N gate and BLOCK_N up columns
        n, bn, sk = n // 2, bn // 2, 1
    bn, bk, sk = block_n or bn, block_k or bk, split_k or sk
    if swiglu and sk != 1:
        raise ValueError("swiglu does not split K")
    if sk < 1 or bn < 16 or bk < 16 or bn & (bn - 1) or bk & (bk - 1):
        raise ValueError(f"bad tiling block_n={bn} block_k={bk} split_k={sk}: powers of 2 "
                         f">= 16 and split_k >= 1")
    block_m = min(64, max(16, triton.next_power_of_2(max(m, 1))))
    if block_k is None and weight.element_size() == 4:
        bk = 64  # fp32 tiles: half the K depth, so the pipeline fits in shared memory
    stage = (block_m * bk + bk * bn * (2 if swiglu else 1)) * weight.element_size()
    num_stages = fit_stages(num_stages, stage)
    k_per = triton.cdiv(triton.cdiv(k, sk), bk) * bk
    sk = triton.cdiv(k, k_per)
    out_dtype = out_dtype or x.dtype
    if partials:
        part = y = torch.empty(sk, m, n, dtype=torch.float32, device=x.device)
    else:
        y = torch.empty(m, n, dtype=out_dtype, device=x.device)
        part = torch.empty(sk, m, n, dtype=torch.float32, device=x.device) if sk > 1 else y
    if m == 0:
        return y, None, None
    n_tiles = triton.cdiv(n, bn)
    vals = idx = y
    if argmax:
        vals = torch.empty(m, n_tiles, dtype=torch.float32, device=x.device)
        idx = torch.empty(m, n_tiles, dtype=torch.int32, device=x.device)
    launch = pdl_launch(x.device)
    b = bias if bias is not None else weight
    round_to_x = out_dtype.itemsize > x.dtype.itemsize
    xd, wd = x, weight
    if use_tma(x, weight) if tma is None else tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xd = TensorDescriptor.from_tensor(x, [block_m, bk])
        wd = TensorDescriptor.from_tensor(weight, [bn, bk])
    _decode_linear_kernel[(n_tiles, triton.cdiv(m, block_m), sk)](
        x, weight, xd, wd, b, y, part, vals, idx, m, n, k, k_per, x.stride(0),
        weight.stride(0), y.stride(-2), HAS_BIAS=bias is not None, SWIGLU=swiglu,
        PARTIALS=partials or sk > 1, ROUND_TO_X=round_to_x, ARGMAX=argmax,
        PRECISION=dot_precision(weight),
        TMA=xd is not x, SILU=silu and sk == 1, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=4, num_stages=num_stages, **launch)
    if sk > 1 and not partials:
        block = min(1024, triton.next_power_of_2(n))
        _split_k_reduce_kernel[(m, triton.cdiv(n, block))](
            part, b, y, x, m, n, y.stride(0), HAS_BIAS=bias is not None, SPLIT_K=sk,
            ROUND_TO_X=round_to_x, SILU=silu, BLOCK=block, num_warps=4, **launch)
    return (y, vals, idx) if argmax else (y, None, None)
