"""Paged decode attention, split-K over each request's KV (flash-decoding)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from latentserve import settings
from latentserve.ops.kernels.pdl import (
    pdl_launch,
    pdl_wait,
    prefetch_l2,
    prefetch_share,
    share_args,
)

_LOG2E = 1.4426950408889634
STAGE1_STAGES = 3  # Triton's default (one K/V tile in flight ahead); 2 and 4 measured the same


def prefetch_budget() -> int:
    """Bytes of the next weight decode attention prefetches to L2:
    ``LATENTSERVE_ATTN_PREFETCH_MB`` (default 8; 0: off)."""
    return int(settings.get("LATENTSERVE_ATTN_PREFETCH_MB") * (1 << 20))


@triton.jit
def _decode_stage1_kernel(
    Q, KCache, VCache, PageTable, Rows, KvLens, MidO, MidLse, Out,
    sm_scale_log2,
    stride_qt, stride_qh,
    stride_ks, stride_kh, stride_vs, stride_vh,
    stride_pt,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    stride_ot, stride_oh,
    last_slot, Next, next_last,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    DIRECT: tl.constexpr, ROW_LINES: tl.constexpr, KV_LINE: tl.constexpr,
    NEXT_LINES: tl.constexpr, LINE: tl.constexpr, PDL: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    # Before the PDL wait: the batch's metadata (not written by a PDL kernel, see the
    # module docstring) and an L2 prefetch of the first tile's K/V rows.
    row = tl.load(Rows + b).to(tl.int64)
    kv_len = tl.load(KvLens + b)
    chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)
    if PDL:  # noqa: SIM102 - a compile-time branch around a runtime one
        if end > start:
            first = tl.minimum(start + tl.arange(0, BLOCK_N), end - 1)
            s0 = tl.load(PageTable + row * stride_pt + first)
            s0 = tl.minimum(tl.maximum(s0, 0), last_slot).to(tl.int64)
            lines = tl.minimum(tl.arange(0, ROW_LINES) * KV_LINE, HEAD_DIM - 1)
            prefetch_l2(KCache + s0[:, None] * stride_ks + kvh * stride_kh + lines[None, :], PDL)
            prefetch_l2(VCache + s0[:, None] * stride_vs + kvh * stride_vh + lines[None, :], PDL)
    pdl_wait(PDL)

    if end > start:
        offs_h = tl.arange(0, BLOCK_H)
        offs_d = tl.arange(0, BLOCK_D)
        heads = kvh * GROUP + offs_h
        mask_h = offs_h < GROUP
        mask_d = offs_d < HEAD_DIM
        q = tl.load(Q + b.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)

        m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        pt_row = PageTable + row * stride_pt
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            slots = tl.load(pt_row + offs_n, mask=mask_n, other=0).to(tl.int64)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(KCache + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                        mask=kv_mask, other=0.0).to(q.dtype)
            qk = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale_log2
            qk = tl.where(mask_n[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(VCache + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                        mask=kv_mask, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new

        # Every row of a non-empty split saw at least one key, so l_i > 0 for real heads.
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        if DIRECT:  # the only split: this is the output (stage 2 is not launched)
            dst = Out + b.to(tl.int64) * stride_ot + heads[:, None] * stride_oh
            tl.store(dst + offs_d[None, :], out.to(Out.dtype.element_ty),
                     mask=mask_h[:, None] & mask_d[None, :])
        else:
            lse = m_i + tl.log2(l_safe)
            mid = MidO + b * stride_mo_b + heads[:, None] * stride_mo_h + split * stride_mo_s
            tl.store(mid + offs_d[None, :], out, mask=mask_h[:, None] & mask_d[None, :])
            tl.store(MidLse + b * stride_ml_b + heads * stride_ml_h + split, lse, mask=mask_h)
    # the next kernel's weight (o_proj) into L2 while the last programs finish
    prefetch_share(Next, next_last, (b * tl.num_programs(1) + kvh) * NUM_SPLITS + split,
                   NEXT_LINES, LINE, PDL)


@triton.jit
def _decode_stage2_kernel(
    MidO, MidLse, KvLens, Out,
    stride_mo_b, stride_mo_h, stride_mo_s,
    stride_ml_b, stride_ml_h,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    pdl_wait(PDL)
    kv_len = tl.load(KvLens + b)
    chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM

    m = -1.0e30
    l = 0.0
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for s in range(NUM_SPLITS):
        if s * chunk < kv_len:
            lse_s = tl.load(MidLse + b * stride_ml_b + h * stride_ml_h + s)
            o_s = tl.load(MidO + b * stride_mo_b + h * stride_mo_h + s * stride_mo_s + offs_d,
                          mask=mask_d, other=0.0)
            m_new = tl.maximum(m, lse_s)
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse_s - m_new)
            acc = acc * alpha + o_s * w
            l = l * alpha + w
            m = m_new
    out = acc / l
    tl.store(Out + b.to(tl.int64) * stride_ot + h * stride_oh + offs_d,
             out.to(Out.dtype.element_ty), mask=mask_d)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_table: torch.Tensor, rows: torch.Tensor, kv_lens: torch.Tensor,
                     scale: float, out: torch.Tensor | None = None, num_kv_splits: int = 8,
                     block_n: int = 64, mid_o: torch.Tensor | None = None,
                     mid_lse: torch.Tensor | None = None,
                     prefetch_next: torch.Tensor | None = None, num_warps: int = 4
                     ) -> torch.Tensor:
    """Decode attention (one query per request) over paged KV, fp32 softmax statistics.

    q ``[B, num_heads, head_dim]`` fp32/bf16/fp16; k_cache/v_cache ``[num_slots + 1,
    num_kv_heads, head_dim]`` (any float dtype); ``page_table`` int64, ``rows [B] int64``,
    ``kv_lens [B] int32`` (>= 1). ``num_kv_splits`` 1: no stage 2. ``block_n`` >= 16, power of
    2. ``mid_o``/``mid_lse``: optional fp32 scratch. ``prefetch_next``: an L2 hint (PDL only).
    ``num_warps``: of stage 1.
    Returns ``[B, num_heads, head_dim]`` in q's dtype (into ``out`` when given)."""
    bsz, n_heads, d = q.shape
    n_kv = k_cache.shape[1]
    assert n_heads % n_kv == 0, "num_heads must be a multiple of num_kv_heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert page_table.stride(-1) == 1
    group = n_heads // n_kv
    if out is None:
        out = torch.empty_like(q)
    if bsz == 0:
        return out
    direct = num_kv_splits == 1
    if direct:  # no partial results to keep: any float32 buffers stand in (never written)
        mid_o = mid_lse = out.new_empty((1, 1, 1, 1), dtype=torch.float32)
    if mid_o is None:
        mid_o = torch.empty((bsz, n_heads, num_kv_splits, d), dtype=torch.float32,
                            device=q.device)
    if mid_lse is None:
        mid_lse = torch.empty((bsz, n_heads, num_kv_splits), dtype=torch.float32,
                              device=q.device)
    block_d = triton.next_power_of_2(d)
    nxt, next_last, next_lines, line = share_args(
        prefetch_next, prefetch_budget(), bsz * n_kv * num_kv_splits, out)
    _decode_stage1_kernel[(bsz, n_kv, num_kv_splits)](
        q, k_cache, v_cache, page_table, rows, kv_lens, mid_o, mid_lse, out,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        page_table.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        k_cache.shape[0] - 1, nxt, next_last,
        GROUP=group, HEAD_DIM=d, NUM_SPLITS=num_kv_splits,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        DIRECT=direct, NEXT_LINES=next_lines, LINE=line, KV_LINE=128 // k_cache.element_size(),
        ROW_LINES=triton.next_power_of_2(triton.cdiv(d * k_cache.element_size(), 128)),
        num_warps=num_warps, num_stages=STAGE1_STAGES, **pdl_launch(q.device),
    )
    if direct:
        return out
    _decode_stage2_kernel[(bsz, n_heads)](
        mid_o, mid_lse, kv_lens, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        HEAD_DIM=d, NUM_SPLITS=num_kv_splits, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=1 if block_d <= 64 else 2, **pdl_launch(q.device),
    )
    return out
