"""Token sampling for a batch: greedy, temperature, top-k, top-p, min-p and per-request seeds.

Filters follow the usual definitions (vLLM ``v1/sample/sampler.py``, HF logits warpers):
top-k keeps the k largest logits, top-p the smallest set whose probability mass reaches p,
min-p drops tokens whose probability is below ``min_p * max_prob``.
"""

from __future__ import annotations

import torch

from latentserve.core import Req


def sample(logits: torch.Tensor, reqs: list[Req], generator: torch.Generator | None = None
           ) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: ``[B, vocab] float32``, row b for ``reqs[b]``.
        reqs: the requests (their ``params`` and, for seeded ones, ``generator``).
        generator: for unseeded sampled rows; None uses torch's global RNG.
    Returns:
        ``[B] int64`` token ids on ``logits.device``.
    """
    out = logits.argmax(dim=-1)
    sampled = [b for b, r in enumerate(reqs) if not r.params.greedy]
    if not sampled:
        return out
    rows = torch.tensor(sampled, device=logits.device)
    probs = _filtered_probs(logits[rows], [reqs[b].params for b in sampled])
    for j, b in enumerate(sampled):
        gen = reqs[b].generator or generator
        out[b] = torch.multinomial(probs[j], 1, generator=gen)[0]
    return out


def _filtered_probs(logits: torch.Tensor, params) -> torch.Tensor:
    dev = logits.device
    temp = torch.tensor([p.temperature for p in params], device=dev)[:, None]
    logits = logits / temp
    top_k = [p.top_k for p in params]
    if any(k > 0 for k in top_k):
        vocab = logits.shape[-1]
        k = torch.tensor([k if 0 < k < vocab else vocab for k in top_k], device=dev)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], device=dev)
    if bool((top_p < 1).any()):
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches p (the first token is kept).
        drop = (cum - sorted_logits.softmax(-1)) >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, idx, sorted_logits)
    probs = logits.softmax(-1)
    min_p = torch.tensor([p.min_p for p in params], device=dev)
    if bool((min_p > 0).any()):
        keep = probs >= min_p[:, None] * probs.max(-1, keepdim=True).values
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
