"""Latent input vectors as the engine keeps them: a ``(tensor, row)`` pair per latent position.

One step computes the next latent inputs of all its rows in one ``[N, hidden]`` tensor; each
request remembers ``(tensor, row)`` (the vector is ``tensor[row]``) instead of a view of its
own, so no per-row tensor is built on the host. When the next forward injects the vectors of
rows ``r0 .. r0 + n - 1`` of one tensor in order (the common all-latent decode batch), the
slice is used as it is; rows of one tensor in another order cost one ``index_select``; only
vectors from several tensors (a recomputed prefill after a preemption, say) are stacked row
by row. The tensors must not be overwritten while a request holds them (copy a CUDA graph's
static output before keeping it).
"""

from __future__ import annotations

import torch


def as_rows(tensor: torch.Tensor) -> list[tuple[torch.Tensor, int]]:
    """``(tensor, j)`` for each row ``j`` of ``tensor [N, hidden]``."""
    return [(tensor, j) for j in range(tensor.shape[0])]


def vector(entry: tuple[torch.Tensor, int]) -> torch.Tensor:
    """The ``[hidden]`` vector of one entry."""
    tensor, row = entry
    return tensor[row]


def common_source(entries: list[tuple[torch.Tensor, int]]) -> torch.Tensor | None:
    """The tensor every entry points into, or None when they point into several."""
    src = entries[0][0]
    for t, _ in entries:
        if t is not src:
            return None
    return src


def stack(entries: list[tuple[torch.Tensor, int]]) -> torch.Tensor:
    """The entries' vectors as one ``[n, hidden]`` tensor (may be a view of a source; do not
    write to it): a slice when they are consecutive rows of one tensor, else one
    ``index_select`` (one tensor) or a stack (several)."""
    src = common_source(entries)
    if src is None:
        return torch.stack([t[r] for t, r in entries])
    rows = [r for _, r in entries]
    r0 = rows[0]
    if rows == list(range(r0, r0 + len(rows))):
        return src[r0 : r0 + len(rows)]
    return src.index_select(0, torch.tensor(rows, dtype=torch.long, device=src.device))
