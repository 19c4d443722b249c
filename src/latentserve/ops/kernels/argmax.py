"""Row-wise argmax of a logits matrix in two short passes: greedy sampling's token pick.

Design notes: docs/internals.md, "latentserve.ops.kernels.argmax".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from latentserve.ops.kernels.pdl import pdl_launch, pdl_wait


@triton.jit
def _first_max(vals, idx, n):
    # (value, index) of the first maximum of `vals` among the entries with idx < n (others
    # must hold -inf and an index >= n); NaN beats every number, the first NaN wins.
    nan = vals != vals  # noqa: PLR0124 - true exactly for NaN
    first_nan = tl.min(tl.where(nan, idx, n))
    best = tl.max(tl.where(nan, -float("inf"), vals))
    first_best = tl.min(tl.where(vals == best, idx, n))
    has_nan = first_nan < n
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, first_nan, first_best)


@triton.jit
def first_max_rows(vals, idx, n):
    """Per row of ``vals [R, C]``, ``(value [R], index [R])`` of its first maximum among
    columns with ``idx [C] < n`` (others hold -inf); the first NaN wins. Argmax pass 1."""
    nan = vals != vals  # noqa: PLR0124 - true exactly for NaN
    first_nan = tl.min(tl.where(nan, idx[None, :], n), axis=1)
    best = tl.max(tl.where(nan, -float("inf"), vals), axis=1)
    first_best = tl.min(tl.where(vals == best[:, None], idx[None, :], n), axis=1)
    has_nan = first_nan < n
    return tl.where(has_nan, float("nan"), best), tl.where(has_nan, first_nan, first_best)


@triton.jit
def allowed_cols(Bits, row, offs, ok, n_words):
    """Which columns ``offs`` of ``row`` a token bitmask allows (bit t % 32 of word t // 32;
    words past ``n_words`` allow nothing), within ``ok``."""
    word = offs // 32
    w = tl.load(Bits + row.to(tl.int64) * n_words + word, mask=ok & (word < n_words), other=0)
    return ok & (((w >> (offs % 32)) & 1) != 0)


@triton.jit
def _argmax_chunks_kernel(X, Bits, Vals, Idx, n_cols, n_chunks, stride_x, n_words,
                          MASKED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_cols
    take = ok
    if MASKED:
        take = allowed_cols(Bits, row, offs, ok, n_words)
    x = tl.load(X + row.to(tl.int64) * stride_x + offs, mask=take, other=-float("inf"))
    v, i = _first_max(x.to(tl.float32), tl.where(ok, offs, n_cols), n_cols)
    tl.store(Vals + row * n_chunks + chunk, v)
    tl.store(Idx + row * n_chunks + chunk, i)


@triton.jit
def _argmax_rows_kernel(Vals, Idx, Out, n_cols, n_chunks, PDL: tl.constexpr,
                        BLOCK_C: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_C)
    ok = offs < n_chunks
    pdl_wait(PDL)
    v = tl.load(Vals + row * n_chunks + offs, mask=ok, other=-float("inf"))
    i = tl.load(Idx + row * n_chunks + offs, mask=ok, other=n_cols)
    # chunks are in index order, so the first maximal chunk holds the first maximal index
    _, best = _first_max(v, tl.where(ok, i, n_cols), n_cols)
    tl.store(Out + row, best.to(tl.int64))


def check_rows(x: torch.Tensor, block: int, name: str = "x") -> None:
    """Raise ValueError (naming ``name``) unless ``x`` is ``[B, V]`` fp32/bf16/fp16 with
    V > 0 and a contiguous last dim, and ``block`` a power of 2 >= 16: the input of a
    two-pass row kernel (this one, ``ops.kernels.gumbel``)."""
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"{name} must be float32, bfloat16 or float16, got {x.dtype}")
    if x.dim() != 2 or x.shape[1] == 0 or x.stride(-1) != 1:
        raise ValueError(f"{name} must be [B, V] with V > 0 and a contiguous last dim, got "
                         f"{tuple(x.shape)}")
    if block < 16 or block & (block - 1):
        raise ValueError(f"block must be a power of 2 >= 16, got {block}")


def check_bits(bits: torch.Tensor | None, x: torch.Tensor) -> None:
    """Raise ValueError unless ``bits`` is None or a contiguous ``[B, W]`` int32 token
    bitmask on ``x``'s device (``x``: ``[B, V]`` logits)."""
    b = x.shape[0]
    if bits is not None and (bits.dim() != 2 or bits.shape[0] != b or bits.dtype != torch.int32
                             or not bits.is_contiguous() or bits.device != x.device):
        raise ValueError(f"bits must be a contiguous [{b}, W] int32 tensor on {x.device}, "
                         f"got {tuple(bits.shape)} {bits.dtype} on {bits.device}")


def argmax_rows(x: torch.Tensor, block: int = 4096, bits: torch.Tensor | None = None
                ) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` bit for bit, in two passes: ``x`` ``[B, V]``
    fp32/bf16/fp16, last dim contiguous; ``block`` a power of 2 >= 16. ``bits``: a token
    mask, ``[B, W]`` int32 contiguous on ``x``'s device (bit ``t % 32`` of ``bits[b, t // 32]``
    set = token t allowed; columns past ``32 W`` disallowed), read as -inf where it
    disallows, or None. Returns ``[B] int64`` (the first NaN where a row has one). Raises
    ValueError for another shape, stride, dtype, block or mask."""
    check_rows(x, block)
    check_bits(bits, x)
    b, v = x.shape
    out = torch.empty(b, dtype=torch.int64, device=x.device)
    if b == 0:
        return out
    n_chunks = triton.cdiv(v, block)
    vals = torch.empty(b, n_chunks, dtype=torch.float32, device=x.device)
    idx = torch.empty(b, n_chunks, dtype=torch.int32, device=x.device)
    _argmax_chunks_kernel[(b, n_chunks)](x, x if bits is None else bits, vals, idx, v, n_chunks,
                                         x.stride(0), 0 if bits is None else bits.shape[1],
                                         MASKED=bits is not None, BLOCK=block,
                                         num_warps=8 if block >= 2048 else 4)
    _argmax_rows_kernel[(b,)](vals, idx, out, v, n_chunks, PDL=False,
                              BLOCK_C=max(16, triton.next_power_of_2(n_chunks)), num_warps=1)
    return out


def argmax_of_chunks(vals: torch.Tensor, idx: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Argmax pass 2 over chunk results (``vals`` ``[B, C]`` fp32 chunk maxima, ``idx``
    ``[B, C]`` int32 their first columns, ``n_cols`` = V), with PDL where on. Returns
    ``[B] int64``. Raises ValueError unless both are contiguous ``[B, C]`` fp32 / int32."""
    if (vals.shape != idx.shape or vals.dim() != 2 or vals.dtype != torch.float32
            or idx.dtype != torch.int32 or not (vals.is_contiguous() and idx.is_contiguous())):
        raise ValueError(f"vals and idx must be contiguous [B, C] float32 and int32, got "
                         f"{tuple(vals.shape)} {vals.dtype} and {tuple(idx.shape)} {idx.dtype}")
    b, c = vals.shape
    out = torch.empty(b, dtype=torch.int64, device=vals.device)
    if b == 0:
        return out
    block_c = max(16, triton.next_power_of_2(c))
    _argmax_rows_kernel[(b,)](vals, idx, out, n_cols, c, BLOCK_C=block_c,
                              num_warps=4 if block_c >= 512 else 1, **pdl_launch(vals.device))
    return out
