"""The q/k/v projection of a decode-sized batch with RoPE and the KV store in its epilogue.

Design notes: docs/internals.md, "latentserve.ops.kernels.qkv_rope".
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from latentserve.ops.kernels.decode_linear import (
    dot_precision,
    fit_stages,
    tma_compatible,
    use_tma,
)
from latentserve.ops.kernels.pdl import (
    pdl_launch,
    pdl_wait,
    prefetch_budget,
    prefetch_l2,
    prefetch_lines,
)
from latentserve.ops.kernels.rotary import _rope_halves
from latentserve.ops.kernels.rotary_store_kv import check_kv_pool


@triton.jit
def _pointer_step(x_rows, w1, w2, k0, offs_k, K, m_ok, d_ok, acc1, acc2, PRECISION):
    # One K tile through masked pointer loads; W is [N, K] row-major (nn.Linear), so each
    # half's tile is read as its transpose [BLOCK_K, BLOCK_HALF].
    k = k0 + offs_k
    k_ok = k < K
    x = tl.load(x_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
    w_mask = k_ok[:, None] & d_ok[None, :]
    acc1 = tl.dot(x, tl.load(w1 + k[:, None], mask=w_mask, other=0.0), acc1,
                  input_precision=PRECISION)
    acc2 = tl.dot(x, tl.load(w2 + k[:, None], mask=w_mask, other=0.0), acc2,
                  input_precision=PRECISION)
    return acc1, acc2


@triton.jit(do_not_specialize=["M"])
def _qkv_rope_kernel(
    X, W, XD, WD, B, Q, Cos, Sin, KCache, VCache, Slots,
    M, K, n_q_heads, n_kv_heads,
    stride_xm, stride_wn, stride_qt, stride_qh, stride_ct, stride_st,
    stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h,
    HAS_BIAS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr, TMA: tl.constexpr,
    PREFETCH_K: tl.constexpr = 0, LINE: tl.constexpr = 64,
):
    # XD, WD: TMA descriptors of x and the weight when TMA (tiles past an edge read as
    # zeros; columns past HALF are computed and not stored), else unused.
    pid_m = tl.program_id(0)
    # q heads, then k heads, then v heads (the merged weight's rows); each head's halves in
    # chunks of BLOCK_HALF columns, one chunk (of both halves) per program
    chunks = tl.cdiv(HALF, BLOCK_HALF)
    head = tl.program_id(1) // chunks
    c0 = (tl.program_id(1) % chunks) * BLOCK_HALF
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = c0 + tl.arange(0, BLOCK_HALF)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    d_ok = offs_d < HALF
    col1 = head * HEAD_DIM + offs_d  # output columns (weight rows) of the first half
    if PREFETCH_K > 0:  # the head's weight rows into L2 while the previous kernel ends
        pf = (W + (head * HEAD_DIM + tl.minimum(offs_d, HALF - 1))[:, None].to(tl.int64)
              * stride_wn + tl.minimum(tl.arange(0, PREFETCH_K // LINE) * LINE, K - 1)[None, :])
        prefetch_l2(pf, PDL)
        prefetch_l2(pf + HALF * stride_wn, PDL)
    pdl_wait(PDL)
    x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
    w1 = W + col1[None, :].to(tl.int64) * stride_wn
    w2 = w1 + HALF * stride_wn
    acc1 = tl.zeros((BLOCK_M, BLOCK_HALF), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_HALF), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if TMA:
            x = XD.load([pid_m * BLOCK_M, k0])
            acc1 = tl.dot(x, tl.trans(WD.load([head * HEAD_DIM + c0, k0])), acc1,
                          input_precision=PRECISION)
            acc2 = tl.dot(x, tl.trans(WD.load([head * HEAD_DIM + HALF + c0, k0])), acc2,
                          input_precision=PRECISION)
        else:
            acc1, acc2 = _pointer_step(x_rows, w1, w2, k0, offs_k, K, m_ok, d_ok, acc1, acc2,
                                       PRECISION)

    if HAS_BIAS:
        acc1 += tl.load(B + col1, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        acc2 += tl.load(B + col1 + HALF, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    a1 = acc1.to(X.dtype.element_ty)  # the projection's rounding
    a2 = acc2.to(X.dtype.element_ty)
    mask = m_ok[:, None] & d_ok[None, :]
    rows = offs_m[:, None].to(tl.int64)
    if head < n_q_heads + n_kv_heads:  # q or k: rotate
        c = tl.load(Cos + rows * stride_ct + offs_d[None, :], mask=mask, other=0.0)
        s = tl.load(Sin + rows * stride_st + offs_d[None, :], mask=mask, other=0.0)
        r1, r2 = _rope_halves(a1, a2, c.to(tl.float32), s.to(tl.float32))
        if head < n_q_heads:
            dst = Q + rows * stride_qt + head * stride_qh + offs_d[None, :]
            tl.store(dst, r1.to(Q.dtype.element_ty), mask=mask)
            tl.store(dst + HALF, r2.to(Q.dtype.element_ty), mask=mask)
        else:
            slot = tl.load(Slots + offs_m, mask=m_ok, other=0).to(tl.int64)
            dst = (KCache + slot[:, None] * stride_kc_s + (head - n_q_heads) * stride_kc_h
                   + offs_d[None, :])
            tl.store(dst, r1.to(KCache.dtype.element_ty), mask=mask)
            tl.store(dst + HALF, r2.to(KCache.dtype.element_ty), mask=mask)
    else:  # v: store as is
        slot = tl.load(Slots + offs_m, mask=m_ok, other=0).to(tl.int64)
        dst = (VCache + slot[:, None] * stride_vc_s
               + (head - n_q_heads - n_kv_heads) * stride_vc_h + offs_d[None, :])
        tl.store(dst, a1.to(VCache.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, a2.to(VCache.dtype.element_ty), mask=mask)


WIDE_ROWS = 32  # up to this many rows a wide program costs little more than a narrow one


def default_block_half(half: int, heads: int | None = None, rows: int = 64,
                       num_sms: int = 132) -> int:
    """Columns of each head half per program: ``LATENTSERVE_QKV_BLOCK_HALF`` when fixed, else
    the half rounded up to a power of 2 (at least 16), halved down to 16 while the grid
    (``heads`` x chunks x 64-row tiles of ``rows``; None: not checked) has fewer programs than
    0.7 per SM for more than 32 rows, 0.25 per SM for fewer (where a wide program costs little
    more than a narrow one). Source: ``benchmarks.qkv_tiling`` on an H100 (docs/benchmarks.md):
    the best of 16/32/64 for Llama-1B, Ouro-1.4B, Huginn and SmolLM2 at 1, 16 and 64 rows."""
    from latentserve import settings

    fixed = settings.get("LATENTSERVE_QKV_BLOCK_HALF")
    if fixed != "auto":
        return int(fixed)
    bh = max(16, triton.next_power_of_2(half))
    target = num_sms * (0.7 if rows > WIDE_ROWS else 0.25)
    while heads and bh > 16 and heads * -(-rows // 64) * triton.cdiv(half, bh) < target:
        bh //= 2
    return bh


@functools.cache
def _num_sms(device: torch.device) -> int:
    return (torch.cuda.get_device_properties(device).multi_processor_count
            if device.type == "cuda" else 132)


def _check(x, weight, bias, cos, sin, k_cache, v_cache, slots, n_heads, n_kv) -> int:
    # qkv_rope_store_kv's argument checks, one field at a time; returns head_dim.
    if n_heads < 1 or n_kv < 1:
        raise ValueError(f"n_heads and n_kv must be >= 1, got {n_heads} and {n_kv}")
    if x.dim() != 2 or x.stride(-1) != 1:
        raise ValueError(f"x must be [T, hidden] with a contiguous last dim, got "
                         f"{tuple(x.shape)}")
    t, hidden = x.shape
    heads = n_heads + 2 * n_kv
    if weight.dim() != 2 or weight.shape[1] != hidden or weight.stride(-1) != 1:
        raise ValueError(f"weight must be [rows, {hidden}] (x's hidden) with a contiguous "
                         f"last dim, got {tuple(weight.shape)}")
    if weight.shape[0] % heads or (weight.shape[0] // heads) % 2:
        raise ValueError(f"weight rows ({weight.shape[0]}) must be (n_heads + 2 * n_kv) = "
                         f"{heads} heads of an even head_dim")
    d = weight.shape[0] // heads
    if weight.dtype != x.dtype:
        raise ValueError(f"weight dtype {weight.dtype} must be x's ({x.dtype})")
    if bias is not None and (bias.shape != (weight.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"bias must be [{weight.shape[0]}] {x.dtype}, got "
                         f"{tuple(bias.shape)} {bias.dtype}")
    for name, cs in (("cos", cos), ("sin", sin)):
        if cs.shape != (t, d) or cs.stride(-1) != 1:
            raise ValueError(f"{name} must be [{t}, {d}] with a contiguous last dim, got "
                             f"{tuple(cs.shape)}")
    check_kv_pool(k_cache, v_cache, n_kv, d)
    if slots.shape != (t,) or slots.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"slots must be [{t}] int64 or int32, got {tuple(slots.shape)} "
                         f"{slots.dtype}")
    for name, o in (("weight", weight), ("bias", bias), ("cos", cos), ("sin", sin),
                    ("k_cache", k_cache), ("v_cache", v_cache), ("slots", slots)):
        if o is not None and o.device != x.device:
            raise ValueError(f"{name} is on {o.device}, x on {x.device}")
    return d


def qkv_rope_store_kv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                      cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slots: torch.Tensor, n_heads: int, n_kv: int,
                      *, block_m: int = 64, block_k: int = 128,
                      block_half: int | None = None, num_stages: int = 6,
                      tma: bool | None = None) -> torch.Tensor:
    """The merged q/k/v projection, RoPE (rotate-half) and the KV store in one launch:
    ``qkv = x @ weight.T + bias`` (rounded to x's dtype) then ``apply_rotary_store_kv_`` on
    its views, up to summation order. No host sync (CUDA-graph safe).

    ``x`` ``[T, hidden]`` bf16/fp16/fp32; ``weight`` ``[(n_heads + 2 n_kv) * D, hidden]`` of
    x's dtype, rows q, k, v (``layers.merge_linears``); ``bias`` or None; ``cos``/``sin``
    ``[T, D]``; ``k_cache``/``v_cache`` ``[num_slots + 1, n_kv, D]``; ``slots`` ``[T] int64``;
    last dims contiguous, D even. Tiles: ``block_m``/``block_k`` powers of 2 >= 16,
    ``block_half`` 16..256 (default :func:`default_block_half` for the grid); ``tma`` default
    ``decode_linear.use_tma``. Returns rotated q ``[T, n_heads, D]`` (new, x's dtype).
    Raises ValueError naming the argument on a shape, dtype, stride, device or tiling
    mismatch or an impossible ``tma=True``."""
    d = _check(x, weight, bias, cos, sin, k_cache, v_cache, slots, n_heads, n_kv)
    for name, val in (("block_m", block_m), ("block_k", block_k)):
        if val < 16 or val & (val - 1):
            raise ValueError(f"{name} must be a power of 2 >= 16, got {val}")
    if block_half is not None and (block_half < 16 or block_half > 256
                                   or block_half & (block_half - 1)):
        raise ValueError(f"block_half must be a power of 2 from 16 to 256 (a TMA box's "
                         f"rows), got {block_half}")
    if tma and not tma_compatible(x, weight):
        raise ValueError("tma=True needs 16-bit x and weight of one dtype with 16-byte-"
                         "aligned bases and row strides")
    t, hidden = x.shape
    q = torch.empty(t, n_heads, d, dtype=x.dtype, device=x.device)
    if t == 0:
        return q
    half = d // 2
    block_half = block_half or default_block_half(half, n_heads + 2 * n_kv, t,
                                                  _num_sms(x.device))
    block_k = block_k if weight.element_size() == 2 else min(block_k, 64)
    stage = (block_m * block_k + 2 * block_k * block_half) * weight.element_size()
    num_stages = fit_stages(num_stages, stage)
    xd, wd = x, weight
    if use_tma(x, weight) if tma is None else tma:
        from triton.tools.tensor_descriptor import TensorDescriptor

        xd = TensorDescriptor.from_tensor(x, [block_m, block_k])
        wd = TensorDescriptor.from_tensor(weight, [block_half, block_k])
    grid = (triton.cdiv(t, block_m), (n_heads + 2 * n_kv) * triton.cdiv(half, block_half))
    launch = pdl_launch(x.device)
    line = 128 // weight.element_size()
    prefetch = prefetch_lines(prefetch_budget(), 2 * block_half, grid[0] * grid[1], line,
                              hidden) if launch["PDL"] else 0
    _qkv_rope_kernel[grid](
        x, weight, xd, wd, bias if bias is not None else weight, q, cos, sin, k_cache,
        v_cache, slots,
        t, hidden, n_heads, n_kv,
        x.stride(0), weight.stride(0), q.stride(0), q.stride(1), cos.stride(0), sin.stride(0),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        HAS_BIAS=bias is not None, HEAD_DIM=d, HALF=half, BLOCK_HALF=block_half,
        BLOCK_M=block_m, BLOCK_K=block_k, PRECISION=dot_precision(weight), TMA=xd is not x,
        PREFETCH_K=prefetch, LINE=line, num_warps=4, num_stages=num_stages, **launch,
    )
    return q
