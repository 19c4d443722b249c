"""Rows of the RoPE (cos, sin) table at each token's position, in one PDL launch
(``ops.kernels.pdl``): one program per token clamps its position into the table and copies
its row, bit for bit the table's (torch took a clamp and an index kernel)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from latentserve.ops.kernels.pdl import pdl_launch, pdl_wait


@triton.jit
def _rope_rows_kernel(Table, Pos, Out, last_row, row_elems, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
    t = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    ok = offs < row_elems
    pdl_wait(PDL)
    p = tl.minimum(tl.maximum(tl.load(Pos + t), 0), last_row).to(tl.int64)
    x = tl.load(Table + p * row_elems + offs, mask=ok)
    tl.store(Out + t.to(tl.int64) * row_elems + offs, x, mask=ok)


def rope_rows(table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """``table[positions.clamp(0, len(table) - 1)]`` in one kernel: table
    ``[max_positions, 2, head_dim]`` contiguous (``Rotary.build_table``: cos then sin), any
    dtype; positions ``[T]`` int32/int64 on its device -> ``[T, 2, head_dim]`` in table's dtype
    (a new tensor). Raises ValueError for a non-contiguous or non-3-D table, non-1-D positions
    or two devices."""
    if table.dim() != 3 or not table.is_contiguous() or table.shape[0] == 0:
        raise ValueError(f"table must be a contiguous [max_positions, 2, head_dim], got "
                         f"{tuple(table.shape)}")
    if positions.dim() != 1 or positions.device != table.device:
        raise ValueError(f"positions must be [T] on {table.device}, got "
                         f"{tuple(positions.shape)} on {positions.device}")
    t = positions.shape[0]
    out = torch.empty((t, *table.shape[1:]), dtype=table.dtype, device=table.device)
    if t == 0:
        return out
    row = table.shape[1] * table.shape[2]
    _rope_rows_kernel[(t,)](table, positions.contiguous(), out, table.shape[0] - 1, row,
                            BLOCK=triton.next_power_of_2(row), num_warps=1,
                            **pdl_launch(table.device))
    return out
