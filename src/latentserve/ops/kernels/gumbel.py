"""Temperature sampling of a logits matrix as one Gumbel-max race in two short passes.

Design notes: docs/internals.md, "latentserve.ops.kernels.gumbel".
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from latentserve.ops.kernels.argmax import (
    _first_max,
    allowed_cols,
    argmax_of_chunks,
    check_bits,
    check_rows,
)


@triton.jit(do_not_specialize=["temp", "seed"])
def _gumbel_chunks_kernel(X, Temps, Bits, Vals, Idx, temp, seed, n_cols, n_chunks, stride_x,
                          n_words, PER_ROW: tl.constexpr, MASKED: tl.constexpr,
                          BLOCK: tl.constexpr):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n_cols
    take = ok
    if MASKED:  # a disallowed token is read as -inf
        take = allowed_cols(Bits, row, offs, ok, n_words)
    x = tl.load(X + row.to(tl.int64) * stride_x + offs, mask=take, other=-float("inf"))
    t = tl.load(Temps + row) if PER_ROW else temp
    # one Philox stream per row; u held above 0 (the smallest normal float32): no log(0)
    u = tl.maximum(tl.rand(seed + row, offs), 1.1754943508222875e-38)
    y = x.to(tl.float32) / t - tl.log(-tl.log(u))
    v, i = _first_max(tl.where(ok, y, -float("inf")), tl.where(ok, offs, n_cols), n_cols)
    tl.store(Vals + row * n_chunks + chunk, v)
    tl.store(Idx + row * n_chunks + chunk, i)


def gumbel_sample_rows(logits: torch.Tensor, temperature: float | torch.Tensor, seed: int,
                       block: int = 4096, bits: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row of ``logits`` (``[B, V]`` fp32/bf16/fp16, last dim contiguous), drawn
    from ``softmax(logits / temperature)``: ``argmax(logits / T + g)``, ``g`` standard Gumbel
    noise from Philox keyed by ``seed + row`` (int, 0 <= seed < 2**63 - B) and the column, so
    the same seed gives the same tokens. ``temperature``: one positive float, or a ``[B]``
    float32 tensor on the logits' device. -inf logits are never drawn (a row of -inf only:
    index 0; a NaN logit wins its row). ``bits``: a token mask applied in the race, ``[B, W]``
    int32 contiguous on the logits' device, bit ``t % 32`` of ``bits[b, t // 32]`` set = token t
    allowed (columns past ``32 W`` disallowed), or None. Returns ``[B] int64``. Raises
    ValueError for another shape, stride, dtype, block, temperature or mask."""
    check_rows(logits, block, "logits")
    b, v = logits.shape
    if not 0 <= seed < 2**63 - max(b, 1):
        raise ValueError(f"seed must be in [0, 2**63 - {max(b, 1)}), got {seed}")
    per_row = isinstance(temperature, torch.Tensor)
    if per_row:
        if (temperature.shape != (b,) or temperature.dtype != torch.float32
                or temperature.device != logits.device):
            raise ValueError(f"temperature must be a [{b}] float32 tensor on {logits.device}, "
                             f"got {tuple(temperature.shape)} {temperature.dtype} on "
                             f"{temperature.device}")
        temps, temp = temperature.contiguous(), 1.0
    else:
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        temps, temp = logits, float(temperature)  # Temps is not read
    check_bits(bits, logits)
    if b == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    n_chunks = triton.cdiv(v, block)
    vals = torch.empty(b, n_chunks, dtype=torch.float32, device=logits.device)
    idx = torch.empty(b, n_chunks, dtype=torch.int32, device=logits.device)
    _gumbel_chunks_kernel[(b, n_chunks)](logits, temps, logits if bits is None else bits, vals,
                                         idx, temp, seed, v, n_chunks, logits.stride(0),
                                         0 if bits is None else bits.shape[1],
                                         PER_ROW=per_row, MASKED=bits is not None, BLOCK=block,
                                         num_warps=8 if block >= 2048 else 4)
    return argmax_of_chunks(vals, idx, v)
