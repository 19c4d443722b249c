"""A decode step's inputs, unpacked into the CUDA graph's static buffers in one launch.

Design notes: docs/internals.md, "latentserve.ops.kernels.decode_inputs".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# Batch sizes and offsets change every step: one compile serves them all (the warm-up's).
# NOTE: `Slots` is a slice of the allocator's free list, 16-byte aligned or not from step
# to step: no alignment specialization, or serving would compile a second variant.
@triton.jit(do_not_specialize=["n", "b", "k", "m", "off_dst", "off_w", "dummy_row"],
            do_not_specialize_on_alignment=["Slots"])
def _decode_inputs_kernel(
    Packed, Pending, Table, Slots, Ids, Pos, Rows, KvLens, OutSlots,
    n, b, k, m, off_dst, off_w, stride_table, dummy_row,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    # this program's share of the staged page-table writes
    w_ok = r < m
    w_cell = tl.load(Packed + off_w + r, mask=w_ok, other=0) * stride_table \
        + tl.load(Packed + off_w + m + r, mask=w_ok, other=0)
    tl.store(Table + w_cell, tl.load(Slots + r, mask=w_ok, other=0), mask=w_ok)
    real = r < n
    pad = (r >= n) & (r < b)
    ids = tl.load(Packed + r, mask=real, other=0)
    pos = tl.load(Packed + n + r, mask=real, other=0)
    row_tok = tl.load(Packed + 2 * n + r, mask=real, other=0)
    rows = tl.load(Packed + 3 * n + r, mask=real, other=dummy_row)
    kv = tl.load(Packed + 4 * n + r, mask=real, other=1)
    src = tl.full([BLOCK_R], -1, dtype=tl.int64)
    for k0 in range(0, k, BLOCK_K):  # the pending id each row takes, if any
        kk = k0 + tl.arange(0, BLOCK_K)
        k_ok = kk < k
        dst = tl.load(Packed + off_dst + kk, mask=k_ok, other=-1)
        s = tl.load(Packed + off_dst + k + kk, mask=k_ok, other=-1)
        hit = dst[None, :] == r[:, None]
        src = tl.maximum(src, tl.max(tl.where(hit, s[None, :], -1), 1))
    taken = real & (src >= 0)
    ids = tl.where(taken, tl.load(Pending + tl.maximum(src, 0), mask=taken, other=0), ids)
    cell = row_tok * stride_table + pos
    w = tl.full([BLOCK_R], -1, dtype=tl.int64)
    for m0 in range(0, m, BLOCK_K):  # the staged write of each row's cell, if any
        mm = m0 + tl.arange(0, BLOCK_K)
        m_ok = mm < m
        wc = tl.load(Packed + off_w + mm, mask=m_ok, other=-1) * stride_table \
            + tl.load(Packed + off_w + m + mm, mask=m_ok, other=0)
        hit = (wc[None, :] == cell[:, None]) & m_ok[None, :]
        w = tl.maximum(w, tl.max(tl.where(hit, mm[None, :].to(tl.int64), -1), 1))
    staged = real & (w >= 0)
    slot = tl.load(Table + cell, mask=real & (w < 0), other=0)
    slot = tl.where(staged, tl.load(Slots + tl.maximum(w, 0), mask=staged, other=0), slot)
    tl.store(Ids + r, ids, mask=real)
    tl.store(Pos + r, pos, mask=real)
    live = real | pad
    tl.store(Rows + r, rows, mask=live)
    tl.store(KvLens + r, kv.to(tl.int32), mask=live)
    tl.store(OutSlots + r, slot, mask=live)


def unpack_decode_inputs(packed: torch.Tensor, n: int, b: int, num_pending: int,
                         pending: torch.Tensor | None, table: torch.Tensor, dummy_row: int,
                         ids: torch.Tensor, pos: torch.Tensor, rows: torch.Tensor,
                         kv_lens: torch.Tensor, out_slots: torch.Tensor,
                         num_writes: int = 0, slots: torch.Tensor | None = None) -> None:
    """Write a decode batch's inputs from its packed copy (``[L] int64``, layout in the module
    docstring) into the static buffers: rows ``< n`` get the batch's ids (``pending``
    substituted), slots ``table[row, pos]``, rows and kv_lens; rows ``n..b-1`` get
    ``dummy_row``, one key and slot 0. ``slots`` ``[num_writes]``: staged page-table writes
    (``PageTable.take_staged``) at the cells the packed tail names.

    Raises ValueError for ``n > b``, a buffer shorter than ``b``, ``pending`` missing,
    ``slots`` not ``[num_writes]``, or ``packed`` too short."""
    if not 0 <= n <= b:
        raise ValueError(f"n must be in [0, b={b}], got {n}")
    for name, buf in (("ids", ids), ("pos", pos), ("rows", rows), ("kv_lens", kv_lens),
                      ("out_slots", out_slots)):
        if buf.shape[0] < b or buf.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous with >= {b} entries, got "
                             f"{tuple(buf.shape)}")
    if num_pending and (pending is None or pending.dim() != 1):
        raise ValueError(f"pending must be the [S] previous tokens with num_pending="
                         f"{num_pending}, got {None if pending is None else tuple(pending.shape)}")
    if num_writes and (slots is None or tuple(slots.shape) != (num_writes,)
                       or slots.dtype != torch.int64 or slots.stride(0) != 1):
        raise ValueError(f"slots must be [num_writes={num_writes}] contiguous int64, got "
                         f"{None if slots is None else (tuple(slots.shape), slots.dtype)}")
    tail = 2 * num_pending + 2 * num_writes
    if packed.shape[0] < 5 * n + tail:
        raise ValueError(f"packed holds {packed.shape[0]} entries, needs >= {5 * n + tail}")
    if max(b, num_writes) == 0:
        return
    # NOTE: fixed block sizes, so one compile (CudaGraphRunner's, at capture) serves every
    # batch: a compile inside serving costs a few hundred milliseconds.
    # NOTE: never launched with PDL. Decode attention reads rows, kv_lens and the page table
    # before its own PDL wait (attention/kernels/decode_attention.py), which is safe only
    # while this kernel ends before any later kernel starts.
    off_w = packed.shape[0] - 2 * num_writes
    _decode_inputs_kernel[(triton.cdiv(max(b, num_writes), 64),)](
        packed, pending if num_pending else packed, table, slots if num_writes else packed,
        ids, pos, rows, kv_lens, out_slots, n, b, num_pending, num_writes,
        off_w - 2 * num_pending, off_w, table.stride(0), dummy_row,
        BLOCK_R=64, BLOCK_K=64, num_warps=4)
