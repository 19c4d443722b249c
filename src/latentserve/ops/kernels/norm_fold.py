"""RMSNorm folded into the decode GEMMs on either side of it: no norm kernel between them.

A pre-norm decoder layer runs ``o_proj -> add + RMSNorm -> gate/up`` and
``down -> add + RMSNorm -> q/k/v``. On the decode path each norm was a kernel of its own
(``ops.kernels.rms_norm``, which also summed the producer's split-K partials): 32 launches
per Llama-1B step, each about 2-3 us on the H200 (docs/benchmarks.md, issue 3). Folded:

* **The producer** (``decode_linear_add``: o_proj or down) reduces its own split-K partial
  sums. Every program of a column tile writes its fp32 partial tile, then takes a ticket
  from the tile's counter; the program that draws the last ticket adds the partials in
  split order (so results do not depend on arrival order), rounds the sum as the GEMM's
  output, adds the residual, writes the new residual stream ``h`` and, per row, the sum of
  squares of its tile's columns: ``stats [column tiles, rows]`` fp32. It then resets the
  counter to zero, so a counter buffer serves every launch (``tile_counters``).
  Source: the serial split-K ("stream-K fixup") of CUTLASS's ``Semaphore``; the ordering
  is PTX's release/acquire on an ``atom.acq_rel.gpu`` after a CTA barrier.
* **The consumer** (``decode_linear(norm=)``: gate/up or the LM head;
  ``qkv_rope_store_kv(norm=)``: q/k/v) reads ``h`` instead of a normed copy, computes each
  row's ``rstd = rsqrt(sum(stats) / hidden + eps)`` once, and normalizes each x tile as it
  loads it, with the rounding of ``ops.kernels.rms_norm``: ``x * rstd`` rounded to the
  activation dtype, times the weight, rounded again.

The sum of squares is added in another order than the norm kernel's single-row sum, so
``rstd`` can differ from it in the last fp32 bit, and a normed value then by one bf16 ulp
(tests bound it). Everything else is bit-identical to the unfolded path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class NormIn(NamedTuple):
    """An RMSNorm for a consumer GEMM to apply to its input rows as it loads them.

    stats: ``[column tiles, T]`` fp32, each row's sum of squares per column tile of x (the
        ``decode_linear_add`` that produced x); weight: ``[hidden]`` the norm's weight, in
        x's dtype; eps: added to the mean square."""

    stats: torch.Tensor
    weight: torch.Tensor
    eps: float


def check_norm(norm: NormIn, x: torch.Tensor) -> None:
    """Raise ValueError naming the field of ``norm`` that does not fit ``x [T, hidden]``."""
    t, hidden = x.shape
    if norm.stats.dim() != 2 or norm.stats.shape[1] != t or norm.stats.dtype != torch.float32:
        raise ValueError(f"norm.stats must be [column tiles, {t}] float32, got "
                         f"{tuple(norm.stats.shape)} {norm.stats.dtype}")
    if not norm.stats.is_contiguous():
        raise ValueError("norm.stats must be contiguous")
    if norm.weight.shape != (hidden,) or norm.weight.dtype != x.dtype:
        raise ValueError(f"norm.weight must be [{hidden}] {x.dtype}, got "
                         f"{tuple(norm.weight.shape)} {norm.weight.dtype}")
    if norm.stats.device != x.device or norm.weight.device != x.device:
        raise ValueError("norm.stats and norm.weight must be on x's device")
    if not norm.eps >= 0:
        raise ValueError(f"norm.eps must be >= 0, got {norm.eps}")


def norm_args(norm: NormIn | None, x: torch.Tensor) -> dict:
    """The kernel arguments of an optional ``norm`` (checked): stats, weight, their count,
    1 / hidden, eps and the ``BLOCK_T`` tile; placeholders (x) without one."""
    if norm is None:
        return {"NS": x, "G": x, "n_stats": 1, "inv_n": 1.0, "eps": 0.0, "NORM": False,
                "BLOCK_T": 1}
    check_norm(norm, x)
    n_stats = norm.stats.shape[0]
    return {"NS": norm.stats, "G": norm.weight, "n_stats": n_stats,
            "inv_n": 1.0 / x.shape[1], "eps": float(norm.eps), "NORM": True,
            "BLOCK_T": triton.next_power_of_2(max(n_stats, 1))}


_COUNTERS: dict[torch.device, torch.Tensor] = {}
COUNTERS = 4096
"""Column-tile counters per device: enough for every decode GEMM of a few-dozen-row batch
(a 64-column tiling of an 8192-wide output over one row tile needs 128)."""


def tile_counters(device: torch.device) -> torch.Tensor:
    """The device's ``[COUNTERS]`` int32 zeros that ``decode_linear_add`` draws tickets from
    (every launch leaves them zero). Allocated on first use, which must not be inside
    CUDA-graph capture (a captured fill would not have run): ``LlamaForCausalLM
    .prepare_positions`` and the engine's warm-up call it first. Launches on one device
    must be ordered (one stream, as the engine runs). Raises RuntimeError when first
    called during capture."""
    device = torch.device(device)
    buf = _COUNTERS.get(device)
    if buf is None:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("tile_counters: first call during CUDA-graph capture; call "
                               "it once before capturing")
        buf = _COUNTERS[device] = torch.zeros(COUNTERS, dtype=torch.int32, device=device)
    return buf


@triton.jit
def row_rstd(NS, n_stats, offs_m, m_ok, M, inv_n, eps, BLOCK_T: tl.constexpr):
    """``[BLOCK_M]`` fp32 ``rsqrt(sum_t NS[t, m] * inv_n + eps)`` for rows ``offs_m`` of the
    ``[n_stats, M]`` sums of squares ``NS`` (rows past ``M``: any finite value)."""
    offs_t = tl.arange(0, BLOCK_T)
    sq = tl.load(NS + offs_t[:, None] * M + offs_m[None, :],
                 mask=(offs_t < n_stats)[:, None] & m_ok[None, :], other=0.0)
    return tl.rsqrt(tl.sum(sq, axis=0) * inv_n + eps)


@triton.jit
def norm_tile(x, rstd, G, k, K):
    """The RMSNorm of an x tile ``[BLOCK_M, BLOCK_K]`` (columns ``k``; those past ``K``
    come out zero): ``x * rstd`` rounded to x's dtype, times the weight ``G[k]``, rounded
    again (``ops.kernels.rms_norm``'s rounding)."""
    g = tl.load(G + k, mask=k < K, other=0.0).to(tl.float32)
    xn = (x.to(tl.float32) * rstd[:, None]).to(x.dtype)
    return (xn.to(tl.float32) * g[None, :]).to(x.dtype)


@triton.jit
def add_residual_stats(acc, R, H, SQ, offs_m, offs_n, m_ok, n_ok, M, stride_r, stride_h,
                       tile_n):
    """The producer's epilogue for one output tile: ``h = round(round(acc) + R)`` (the
    GEMM's rounding, then the residual add's) stored to ``H``, and each row's sum of squares
    of ``h`` over the tile's columns to ``SQ[tile_n, rows]``."""
    mask = m_ok[:, None] & n_ok[None, :]
    rows = offs_m[:, None].to(tl.int64)
    r = tl.load(R + rows * stride_r + offs_n[None, :], mask=mask, other=0.0)
    h = (acc.to(R.dtype.element_ty).to(tl.float32) + r.to(tl.float32)).to(R.dtype.element_ty)
    tl.store(H + rows * stride_h + offs_n[None, :], h, mask=mask)
    hf = tl.where(mask, h.to(tl.float32), 0.0)
    tl.store(SQ + tile_n * M + offs_m, tl.sum(hf * hf, axis=1), mask=m_ok)


@triton.jit
def last_split_sum(acc, P, Counters, offs_m, offs_n, m_ok, n_ok, M, N, tile, pid_k, n_split):
    """Serial split-K: store this program's partial tile ``acc`` to ``P[pid_k]``, take a
    ticket from ``Counters[tile]``, and return ``(is_last, total)``: for the program that
    drew the last ticket, the partials of all ``n_split`` splits added in split order (and
    the counter reset to 0); for the others ``is_last`` is false and ``total`` is ``acc``."""
    mask = m_ok[:, None] & n_ok[None, :]
    offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(P + pid_k * M * N + offs, acc, mask=mask)
    tl.debug_barrier()  # every thread's partial stored before the release below
    ticket = tl.atomic_add(Counters + tile, 1, sem="acq_rel", scope="gpu")
    is_last = ticket == n_split - 1
    if is_last:
        acc = tl.zeros_like(acc)
        for s in range(n_split):  # L2 reads (.cg): other SMs wrote these
            acc += tl.load(P + s * M * N + offs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(Counters + tile, 0)
    return is_last, acc
