"""Extend (prefill with a cached prefix) attention over paged KV."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    Q, KCache, VCache, Out, PageTable, Rows, QStart, KvLens,
    sm_scale_log2,
    stride_qt, stride_qh,
    stride_ks, stride_kh, stride_vs, stride_vh,
    stride_ot, stride_oh,
    stride_pt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblock = tl.program_id(2)

    q_start = tl.load(QStart + b)
    q_len = tl.load(QStart + b + 1) - q_start
    if mblock * BLOCK_M < q_len:
        kv_len = tl.load(KvLens + b)
        row = tl.load(Rows + b).to(tl.int64)
        kvh = h // GROUP
        prefix = kv_len - q_len

        offs_m = mblock * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        mask_m = offs_m < q_len
        mask_d = offs_d < HEAD_DIM
        pos = prefix + offs_m  # absolute position of each query token
        tok = (q_start + offs_m).to(tl.int64)
        q = tl.load(Q + tok[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=mask_m[:, None] & mask_d[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        pt_row = PageTable + row * stride_pt
        # Last key any query of this block may see, plus one.
        end = tl.minimum(kv_len, prefix + (mblock + 1) * BLOCK_M)
        for n0 in range(0, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            slots = tl.load(pt_row + offs_n, mask=mask_n, other=0).to(tl.int64)
            kv_mask = mask_n[:, None] & mask_d[None, :]
            k = tl.load(KCache + slots[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                        mask=kv_mask, other=0.0).to(q.dtype)
            qk = tl.dot(q, tl.trans(k), input_precision="ieee") * sm_scale_log2
            visible = mask_n[None, :] & (offs_n[None, :] <= pos[:, None])
            qk = tl.where(visible, qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(VCache + slots[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                        mask=kv_mask, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new

        # Padding rows (offs_m >= q_len) saw no key; guard their division, they are not stored.
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        out = acc / l_safe[:, None]
        tl.store(Out + tok[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def extend_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     page_table: torch.Tensor, rows: torch.Tensor, q_start: torch.Tensor,
                     kv_lens: torch.Tensor, max_q_len: int, scale: float,
                     out: torch.Tensor | None = None, block_m: int = 64,
                     block_n: int = 64) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole paged KV, fp32 softmax.
    q ``[T, num_heads, head_dim]`` (requests back to back); k_cache/v_cache already hold the
    new K/V; ``rows [B] int64``; ``q_start [B + 1] int32``; ``kv_lens [B] int32`` (>= q_len);
    ``max_q_len`` host int; tiles >= 16, powers of 2. Returns ``[T, num_heads, head_dim]`` in
    q's dtype (into ``out`` when given)."""
    t, n_heads, d = q.shape
    n_kv = k_cache.shape[1]
    assert n_heads % n_kv == 0, "num_heads must be a multiple of num_kv_heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert page_table.stride(-1) == 1
    if out is None:
        out = torch.empty_like(q)
    bsz = rows.shape[0]
    if t == 0 or bsz == 0:
        return out
    block_d = triton.next_power_of_2(d)
    grid = (bsz, n_heads, triton.cdiv(max_q_len, block_m))
    _extend_kernel[grid](
        q, k_cache, v_cache, out, page_table, rows, q_start, kv_lens,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        page_table.stride(0),
        GROUP=n_heads // n_kv, HEAD_DIM=d,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        num_warps=4 if block_d <= 64 else 8,
    )
    return out
