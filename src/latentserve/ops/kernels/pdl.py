"""Programmatic dependent launch (PDL) for the decode path's Triton kernels.

Design notes: docs/internals.md, "latentserve.ops.kernels.pdl".
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from latentserve import settings


@functools.cache
def sm90_or_newer(index: int | None) -> bool:
    """Whether CUDA device ``index`` (None: the current one) has compute capability 9.0 or
    newer (Hopper), which brought PDL and the TMA that ``decode_linear`` reads through.
    Cached per index."""
    return torch.cuda.get_device_capability(index)[0] >= 9


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """A kernel's PDL prologue, called before its first read of an activation and its first
    write: with ``PDL`` let the next kernel launch, then wait for the previous one (its
    writes visible); without, nothing."""
    if PDL:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def prefetch_l2(ptrs, PDL: tl.constexpr):
    """With ``PDL``, ask L2 for the 128-byte line of each address of ``ptrs`` (all inside an
    allocation: clamp, do not mask), before ``pdl_wait``, so weight reads overlap the previous
    kernel's tail. PTX ``prefetch.global.L2``: a hint, results unchanged."""
    if PDL:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [ptrs], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def prefetch_share(Next, next_last, pid, LINES: tl.constexpr, LINE: tl.constexpr,
                   PDL: tl.constexpr):
    """Program ``pid``'s share of another buffer into L2 (``prefetch_l2``): its ``LINES``
    128-byte lines from line ``pid * LINES`` on (clamped to the buffer's last line,
    ``next_last``; ``LINE`` elements each). ``LINES`` 0: nothing."""
    if LINES > 0:
        idx = tl.minimum(pid * LINES + tl.arange(0, LINES), next_last)
        prefetch_l2(Next + idx.to(tl.int64) * LINE, PDL)


def share_args(nxt: torch.Tensor | None, nbytes: int, programs: int,
               stand_in: torch.Tensor) -> tuple:
    """``(Next, next_last, LINES, LINE)`` for ``prefetch_share``: the first ``nbytes`` of
    ``nxt`` over ``programs`` in power-of-2 shares of lines; off (``LINES`` 0) for None,
    0 bytes, under one line, or non-contiguous."""
    if nxt is None or nbytes <= 0 or programs <= 0 or not nxt.is_contiguous():
        return stand_in, 0, 0, 1
    line = max(128 // nxt.element_size(), 1)
    total = min(nxt.numel() // line, nbytes // 128)
    if total == 0:
        return stand_in, 0, 0, 1
    return nxt, total - 1, triton.next_power_of_2(triton.cdiv(total, programs)), line


def prefetch_lines(nbytes: int, rows: int, programs: int, line_elems: int,
                   k_span: int) -> int:
    """Elements of each weight row a GEMM program prefetches: its share of ``nbytes`` over
    ``rows`` rows as a power of 2 of whole lines, at most ``k_span`` rounded up; 0 when under
    a line."""
    per_row = nbytes // max(programs * rows, 1) // (128 // line_elems)  # elements
    lines = min(1 << max(per_row.bit_length() - 1, 0), triton.next_power_of_2(max(k_span, 1)))
    return lines if lines >= line_elems else 0


def prefetch_budget() -> int:
    """Bytes of weights the q/k/v kernel (``qkv_rope``) may prefetch into L2 across all its
    programs before it waits for the previous kernel (``LATENTSERVE_DECODE_PREFETCH_MB``,
    default 3; 0 turns it off; why 3: docs/benchmarks-history.md)."""
    return int(settings.get("LATENTSERVE_DECODE_PREFETCH_MB") * (1 << 20))


def pdl_enabled(device: torch.device) -> bool:
    """True when kernels on ``device`` should launch with PDL: a CUDA device of compute
    capability 9.0 or newer, not the Triton interpreter, and ``LATENTSERVE_PDL`` not "0"."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    if settings.get("LATENTSERVE_PDL") == "0":
        return False
    return sm90_or_newer(device.index if device.index is not None
                                else torch.cuda.current_device())


def pdl_launch(device: torch.device) -> dict:
    """Keyword arguments for a Triton launch: ``{"PDL": bool, "launch_pdl": True}`` when
    PDL is on for ``device``, ``{"PDL": False}`` otherwise (the kernel must declare
    ``PDL: tl.constexpr`` and guard its ``gdc_*`` calls with it)."""
    if pdl_enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
