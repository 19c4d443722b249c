"""Repetition, frequency and presence penalties read from per-request token counts, and the
counts' update, each one launch (vLLM's ``apply_penalties`` rules, ``model_executor/layers/
utils.py``).

Design notes: docs/internals.md, "latentserve.penalties".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 2048


@triton.jit
def _penalize_kernel(X, Out, Counts, Prompt, Rows, Params, big, n_rows, n_cols, stride_x,
                     stride_o, stride_c, BLOCK: tl.constexpr):
    s = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_cols
    x = tl.load(X + s.to(tl.int64) * stride_x + offs, mask=ok)
    r = tl.load(Rows + s)
    if r >= 0:
        at = r * stride_c + offs
        c = tl.load(Counts + at, mask=ok, other=0).to(tl.float32)
        rep = tl.load(Params + s).to(tl.float32)
        freq = tl.load(Params + n_rows + s).to(tl.float32)
        pres = tl.load(Params + 2 * n_rows + s).to(tl.float32)
        y = x.to(tl.float32)
        if rep != 1.0:
            seen = (c > 0) | (tl.load(Prompt + at, mask=ok, other=0) != 0)
            scaled = tl.where(y > 0, tl.math.div_rn(y, rep), y * rep)
            scaled = tl.minimum(tl.maximum(scaled, -big), big)
            y = tl.where(seen, scaled, y)
        y = y - freq * c
        y = y - pres * tl.minimum(c, 1.0)
        tl.store(Out + s.to(tl.int64) * stride_o + offs, y.to(Out.dtype.element_ty), mask=ok)
    else:
        tl.store(Out + s.to(tl.int64) * stride_o + offs, x, mask=ok)


def penalize(logits: torch.Tensor, counts: torch.Tensor, prompt: torch.Tensor,
             rows: torch.Tensor, params: torch.Tensor) -> torch.Tensor:
    """A new ``[S, V]`` tensor: row ``s`` of ``logits`` (``[S, V]`` fp32/bf16/fp16, last dim
    contiguous) penalized with row ``rows[s]`` of ``counts`` (``[R, V] int32``, answer-token
    counts) and ``prompt`` (``[R, V] bool``, prompt tokens; read only where the repetition
    penalty is not 1), or copied where ``rows[s]`` is -1. ``rows``: ``[S] int64``;
    ``params``: ``[3 S] float64``, the repetition, frequency and presence penalties of the
    ``S`` rows. Repetition divides positive and multiplies negative logits of tokens seen in
    the prompt or answer (held within the logits dtype's range), then ``- freq * count - pres *
    (count > 0)``. All tensors on one CUDA device (or the Triton interpreter)."""
    s, v = logits.shape
    out = torch.empty_like(logits)
    if s:
        _penalize_kernel[(s, triton.cdiv(v, BLOCK))](
            logits, out, counts, prompt.view(torch.uint8), rows, params,
            torch.finfo(logits.dtype).max, s, v,
            logits.stride(0), out.stride(0), counts.stride(0), BLOCK=BLOCK, num_warps=8)
    return out


@triton.jit
def _count_kernel(Counts, Entries, Tokens, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < n
    base = tl.load(Entries + i, mask=ok, other=0)
    v = tl.load(Entries + n + i, mask=ok, other=0)
    dev = ok & (v < 0)
    t = tl.where(dev, tl.load(Tokens + (-v - 1), mask=dev, other=0), v)
    tl.atomic_add(Counts + base + t, 1, mask=ok)


def count_tokens(counts: torch.Tensor, entries: torch.Tensor, tokens: torch.Tensor) -> None:
    """Add 1 to ``counts`` (``[R, V] int32``, contiguous) at flat index ``entries[i] +
    token_i`` for each of the ``n = len(entries) // 2`` entries: ``entries`` is ``[2 n]
    int64`` (``row * V``, then the values), value ``v >= 0`` is the token itself and ``v < 0``
    names ``tokens[-v - 1]`` (``[T] int64``, sampled ids still on the device). In place."""
    n = entries.numel() // 2
    if n:
        _count_kernel[(triton.cdiv(n, 256),)](counts, entries, tokens, n, BLOCK=256)
