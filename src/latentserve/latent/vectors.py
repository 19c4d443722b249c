"""Latent input vectors as the engine keeps them: a ``(tensor, row)`` pair per position."""

from __future__ import annotations

import torch

from latentserve.staging import to_device


def as_rows(tensor: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """``(tensor, j)`` for each row ``j`` of ``tensor [N, hidden]``."""
    return [(tensor, j) for j in range(tensor.shape[0])]


def common_source(entries: list[tuple[torch.Tensor, int]]) -> torch.Tensor | None:
    """The tensor every entry points into, or None when they point into several."""
    src = entries[0][0]
    return src if all(t is src for t, _ in entries) else None


def stack(entries: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """The entries' vectors as one ``[n, hidden]`` tensor (maybe a view: read only)."""
    n = len(entries)
    _, src, src_rows = injection_plan(list(range(n)), entries, n)
    if src is None:
        return torch.stack([t[r] for t, r in entries])
    if not src_rows:
        return src
    return src.index_select(0, to_device(src_rows, torch.long, src.device))


def injection_plan(rows: list[int], entries: list[tuple[torch.Tensor, int]], t: int
                   ) -> tuple[list[int], torch.Tensor | None, list[int]]:
    """``(mask, src, src_rows)`` for ``entries[i]`` at token row ``rows[i]`` of ``t`` rows:
    ``mask`` ``[t]`` 0/1 (``[]``: all); ``src`` the one source tensor (None: several, use
    :func:`stack_at`); ``src_rows`` ``[t]`` rows of ``src`` (``[]``: ``src`` is the input)."""
    full = len(rows) == t  # every row injects (a latent decode batch)
    mask = [] if full else [0] * t
    for r in [] if full else rows:
        mask[r] = 1
    src = common_source(entries)
    if src is None:
        return mask, None, []
    src_idx = [r for _, r in entries]
    r0 = src_idx[0]
    if full and src_idx == list(range(r0, r0 + t)):
        return mask, src[r0 : r0 + t], []
    if full:
        return mask, src, src_idx
    src_rows = [r0] * t
    for r, v in zip(rows, src_idx):
        src_rows[r] = v
    return mask, src, src_rows


def stack_at(rows: list[int], entries: list[tuple[torch.Tensor, int]], t: int
             ) -> torch.Tensor:
    """``[t, hidden]``: ``entries[i]``'s vector at row ``rows[i]``, zeros elsewhere (entries
    from several tensors, e.g. a prefill recomputed after a preemption)."""
    vecs = [t[r] for t, r in entries]
    if len(rows) < t:
        full = [vecs[0].new_zeros(vecs[0].shape)] * t
        for r, v in zip(rows, vecs):
            full[r] = v
        vecs = full
    return torch.stack(vecs)
