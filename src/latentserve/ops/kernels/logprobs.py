"""The sampled token's log-probability, its rank and the top-k alternatives of each row of
a logits matrix, packed for one copy to the host: two launches and a ``topk``.

Design notes: docs/internals.md, "latentserve.sampling" (logprobs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _score_kernel(X, Targets, Out, Stats, n_cols, stride_x, stride_o, BLOCK: tl.constexpr):
    # torch's log_softmax, (x - max) - log(sum(exp(x - max))), in three passes over the row,
    # so that the rank counts the same rounded values as vLLM's (logprobs > its own).
    row = tl.program_id(0)
    base = X + row.to(tl.int64) * stride_x
    t = tl.load(Targets + row)
    m = -float("inf")
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < n_cols, other=-float("inf")).to(tl.float32)
        m = tl.maximum(m, tl.max(x))
    s = 0.0
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < n_cols, other=-float("inf")).to(tl.float32)
        s += tl.sum(tl.exp(x - m))
    log_sum = tl.log(s)
    lp = (tl.load(base + t).to(tl.float32) - m) - log_sum
    greater = 0
    for start in range(0, n_cols, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < n_cols, other=-float("inf")).to(tl.float32)
        greater += tl.sum((((x - m) - log_sum) > lp).to(tl.int32))
    out = Out + row.to(tl.int64) * stride_o
    tl.store(out, t.to(tl.float64))
    tl.store(out + 1, lp.to(tl.float64))
    tl.store(out + 2, (greater + 1).to(tl.float64))
    tl.store(Stats + 2 * row, m)
    tl.store(Stats + 2 * row + 1, log_sum)


@triton.jit
def _pack_top_kernel(Vals, Idx, Stats, Out, k, stride_o, BLOCK_K: tl.constexpr):
    row = tl.program_id(0)
    j = tl.arange(0, BLOCK_K)
    ok = j < k
    v = tl.load(Vals + row * k + j, mask=ok, other=0.0).to(tl.float32)
    i = tl.load(Idx + row * k + j, mask=ok, other=0)
    m = tl.load(Stats + 2 * row)  # (v - max) - log(sum), as for the target
    log_sum = tl.load(Stats + 2 * row + 1)
    out = Out + row.to(tl.int64) * stride_o + 3
    tl.store(out + j, i.to(tl.float64), mask=ok)
    tl.store(out + k + j, ((v - m) - log_sum).to(tl.float64), mask=ok)


def score_rows_cuda(logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """``sampling.score_rows`` on CUDA: row i of ``logits`` (``[N, V]`` fp32/bf16/fp16, last
    dim contiguous) scoring ``targets[i]`` (``[N] int64``), packed as ``[N, 3 + 2k]
    float64``: the target, its log-probability (torch's log-softmax in fp32, ``(x - max) -
    log(sum(exp(x - max)))``, in three passes), its rank (1 + the log-probabilities above
    its own), then the top ``min(k, V)`` ids (``torch.topk``
    of the logits) and their log-probabilities."""
    n, v = logits.shape
    k = min(k, v)
    out = torch.empty(n, 3 + 2 * k, dtype=torch.float64, device=logits.device)
    if n == 0:
        return out
    stats = torch.empty(n, 2, dtype=torch.float32, device=logits.device)  # max, log(sum)
    _score_kernel[(n,)](logits, targets, out, stats, v, logits.stride(0), out.stride(0),
                        BLOCK=BLOCK, num_warps=8)
    if k > 0:
        vals, idx = logits.topk(k, dim=-1)
        _pack_top_kernel[(n,)](vals, idx, stats, out, k, out.stride(0),
                               BLOCK_K=triton.next_power_of_2(k))
    return out
