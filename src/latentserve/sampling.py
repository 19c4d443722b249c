"""Token sampling for a batch: token masks, logit bias, penalties, greedy, temperature,
top-k/p, min-p, seeds, logprobs.
Design notes: docs/internals.md, "latentserve.sampling"."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from latentserve.core import Req
from latentserve.outputs import TokenLogprob
from latentserve.penalties import PenaltyCounts, apply_penalties
from latentserve.sampling_params import SamplingParams
from latentserve.staging import to_device


@dataclass(slots=True)
class SamplerOutput:
    """``tokens``: ``[B] int64`` sampled ids. The rows ``scored`` (their request set
    ``params.logprobs``, ``ks`` top alternatives each) have their log-probabilities in
    ``scores`` (:func:`score_rows`, still on the device; None when no row is scored):
    :meth:`read` (or ``logprobs``, which waits for the device) turns them into
    ``TokenLogprob``s."""

    tokens: torch.Tensor
    scored: list[int]
    ks: list[int]
    scores: torch.Tensor | None

    def read(self, scores: torch.Tensor | None = None) -> list[TokenLogprob | None]:
        """Per batch row its ``TokenLogprob`` (None for rows not scored), from ``scores`` (a
        host copy of ``self.scores``; None: ``self.scores``, waiting for the device)."""
        out: list[TokenLogprob | None] = [None] * len(self.tokens)
        src = self.scores if scores is None else scores
        if src is not None:
            for b, lp in zip(self.scored, unpack_scores(src, self.ks)):
                out[b] = lp
        return out

    @property
    def logprobs(self) -> list[TokenLogprob | None]:
        return self.read()


@dataclass(slots=True)
class TokenMask:
    """Which tokens some rows of a batch may take: ``bits[i]`` (``[M, ceil(vocab / 32)]
    int32`` on the logits' device; bit ``t % 32`` of word ``t // 32`` set = token t allowed)
    is the mask of batch row ``rows[i]``; other rows are unmasked."""

    rows: list[int]
    bits: torch.Tensor


@dataclass(slots=True)
class LogitBias:
    """Additive biases on some logits of a batch (``SamplingParams.logit_bias``):
    ``logits[rows[k], ids[k]] += values[k]``; ``rows``, ``ids``: ``[K] int64``, ``values``:
    ``[K] float64``, on the logits' device; each ``(row, id)`` pair at most once."""

    rows: torch.Tensor
    ids: torch.Tensor
    values: torch.Tensor


def sample_with_logprobs(logits: torch.Tensor, reqs: list[Req],
                         generator: torch.Generator | None = None,
                         greedy: torch.Tensor | None = None,
                         mask: TokenMask | None = None,
                         bias: LogitBias | None = None,
                         penalties: PenaltyCounts | None = None) -> SamplerOutput:
    """One token per row of ``logits`` (``[B, vocab] float32``, not modified) for ``reqs``,
    with the requested log-probabilities (of the raw logits: vLLM's default
    ``raw_logprobs``). Penalties count ``answer_ids`` where present. ``generator``: for
    unseeded rows (None: global RNG); ``greedy``: ``[B] int64`` argmax the caller already
    has, used unless a row has penalties, a mask or a bias; ``mask``: a :class:`TokenMask` or
    None; ``bias``: a :class:`LogitBias` or None, added after the mask and before the
    penalties (vLLM's order); ``penalties``: the engine's :class:`PenaltyCounts`, counted
    for this step (None: each answer is counted here, whole). Returns ``SamplerOutput`` on
    ``logits.device``, nothing read on the host."""
    raw = logits
    sampled = [b for b, r in enumerate(reqs) if not r.params.greedy]
    every = len(sampled) == len(reqs)  # no index ops (the usual batch)
    # a mask of every row, every row racing or every row greedy: the race or the argmax
    # kernel applies the bits (no masked copy)
    race_bits = argmax_bits = None
    whole = (mask.bits if mask is not None and bias is None and len(mask.rows) == len(reqs)
             and mask.rows == list(range(len(reqs)))
             and not any(r.params.has_penalties for r in reqs) else None)
    if (whole is not None and generator is None and every
            and _one_race(logits, [r.params for r in reqs], [r.generator for r in reqs])):
        race_bits = whole.contiguous()
    elif whole is not None and not sampled and _races_on(logits):
        argmax_bits, greedy = whole.contiguous(), None
    elif mask is not None:
        logits = apply_token_mask(logits, mask)
        greedy = None
    if bias is not None:
        logits = logits.clone() if logits is raw else logits
        logits.index_put_((bias.rows, bias.ids), bias.values.to(logits.dtype), accumulate=True)
        greedy = None
    penalized = any(r.params.has_penalties for r in reqs)
    if penalized:  # a new tensor; rows without penalties copied
        logits = (apply_penalties(logits, reqs) if penalties is None
                  else penalties.apply(logits, reqs))
    if sampled and every:
        out = _draw(logits, reqs, generator, race_bits)
    else:
        out = (greedy if greedy is not None and not penalized
               else greedy_tokens(logits, argmax_bits))
        if sampled:
            idx = to_device(sampled, torch.long, logits.device)
            drawn = _draw(logits[idx], [reqs[b] for b in sampled], generator, None)
            out = out.index_copy(0, idx, drawn)  # out of place: may be a static graph buffer
    scored = [b for b, r in enumerate(reqs) if r.params.logprobs is not None]
    ks = [reqs[b].params.logprobs or 0 for b in scored]
    scores = None
    if len(scored) == len(reqs):  # every row: no index copy
        scores = score_rows(raw, out, max(ks))
    elif scored:
        rows = to_device(scored, torch.long, raw.device)
        scores = score_rows(raw[rows], out[rows], max(ks))
    return SamplerOutput(out, scored, ks, scores)


def _draw(logits: torch.Tensor, reqs: list[Req], generator: torch.Generator | None,
          bits: torch.Tensor | None) -> torch.Tensor:
    """One token per row of ``logits`` for the sampled ``reqs`` (one row each): the fused race
    (``bits``: its token mask) where it can run, else the torch filter chain."""
    params = [r.params for r in reqs]
    gens = [r.generator for r in reqs]
    if bits is not None:
        return _gumbel_tokens(logits, params, bits)
    if generator is None and _one_race(logits, params, gens):
        return _gumbel_tokens(logits, params)
    probs = _filtered_probs(logits, params)
    return greedy_tokens(probs.div_(_exponentials(probs, gens, generator)))


def suppress_(logits: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """``logits`` (``[S, vocab]``) with columns ``ids`` (``[K] int64``, same device; a latent
    spec's ``suppress_ids``, CODI's eot) set to -inf in place, returned; as is for None."""
    return logits if ids is None else logits.index_fill_(1, ids, float("-inf"))


def _one_race(logits: torch.Tensor, params, gens: list) -> bool:
    """Whether the rows of ``logits`` can be drawn by :func:`_gumbel_tokens`: on CUDA, no
    seeded row, no top-k, top-p or min-p filter (decided on the host: no wait)."""
    vocab = logits.shape[-1]
    return (_races_on(logits) and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and all(g is None for g in gens)
            and all((p.top_k <= 0 or p.top_k >= vocab) and p.top_p >= 1 and p.min_p <= 0
                    for p in params))


def _races_on(logits: torch.Tensor) -> bool:
    """Whether ``logits``' device runs the fused race (CUDA; tests point it at the Triton
    interpreter)."""
    return logits.is_cuda


def _gumbel_tokens(logits: torch.Tensor, params, bits: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """One token per row of ``logits`` ``[N, vocab]`` at its row's temperature, in one
    Gumbel-max race on the device (``ops.kernels.gumbel``) keyed by a seed from torch's CPU
    generator (seeded with the engine's seed): two launches in place of the filter chain's
    eight, and no copy when every row has one temperature. ``bits``: a ``[N, W]`` int32 token
    mask the race applies (``TokenMask.bits``), or None."""
    from latentserve.ops.kernels.gumbel import gumbel_sample_rows

    temps = [p.temperature for p in params]
    temperature = (temps[0] if len(set(temps)) == 1
                   else to_device(temps, torch.float32, logits.device))
    seed = int(torch.randint(2**62, ()))
    return gumbel_sample_rows(logits if logits.stride(-1) == 1 else logits.contiguous(),
                              temperature, seed, bits=bits)


def warm_race(vocab_size: int, device) -> None:
    """Compile :func:`_gumbel_tokens`' kernels (one temperature, and one per row; with and
    without a token mask) for fp32 logits of ``vocab_size`` columns on ``device``."""
    from latentserve.token_masks import bitmask_width

    logits = torch.zeros(2, vocab_size, device=device)
    bits = torch.full((2, bitmask_width(vocab_size)), -1, dtype=torch.int32, device=device)
    for mask in (None, bits):
        for temps in ((1.0, 1.0), (1.0, 0.5)):
            _gumbel_tokens(logits, [SamplingParams(temperature=t) for t in temps], mask)


def _exponentials(probs: torch.Tensor, gens: list, generator: torch.Generator | None
                  ) -> torch.Tensor:
    """Exp(1) noise like ``probs`` (``[N, vocab]``) for ``argmax(probs / q)``: rows whose
    ``gens[i]`` is None share one draw from ``generator`` (None: global RNG), row i of a
    seeded request is drawn from ``gens[i]`` (docs/internals.md)."""
    q = torch.empty_like(probs)
    if None in gens:
        q.exponential_(generator=generator)
    for i, gen in enumerate(gens):
        if gen is not None:
            q[i].exponential_(generator=gen)
    return q


def apply_token_mask(logits: torch.Tensor, mask: TokenMask) -> torch.Tensor:
    """A copy of ``logits`` ``[B, vocab]`` with ``mask``'s disallowed tokens at -inf (xgrammar's
    ``apply_token_bitmask_inplace`` when installed, else :func:`unpack_bitmask`)."""
    out = logits.clone()
    if len(mask.rows) == out.shape[0] and mask.rows == list(range(out.shape[0])):
        _apply_bitmask(out, mask.bits)
        return out
    rows = to_device(mask.rows, torch.long, logits.device)
    sub = out.index_select(0, rows)
    _apply_bitmask(sub, mask.bits)
    return out.index_copy_(0, rows, sub)


def _apply_bitmask(logits: torch.Tensor, bits: torch.Tensor) -> None:
    """Set ``logits[i, t]`` (contiguous ``[M, vocab]``) to -inf where bit t of ``bits[i]`` is
    0, in place."""
    vocab = logits.shape[1]
    try:
        from xgrammar import apply_token_bitmask_inplace
    except ImportError:
        apply_token_bitmask_inplace = None  # type: ignore[assignment]
    if apply_token_bitmask_inplace is not None and logits.dtype in (
            torch.float32, torch.bfloat16, torch.float16) and logits.is_contiguous():
        apply_token_bitmask_inplace(logits, bits, vocab_size=min(vocab, bits.shape[1] * 32))
        if vocab > bits.shape[1] * 32:
            logits[:, bits.shape[1] * 32 :] = float("-inf")
        return
    logits.masked_fill_(~unpack_bitmask(bits, vocab), float("-inf"))


def unpack_bitmask(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[M, W] int32`` packed bits -> ``[M, vocab] bool`` (token t allowed = bit ``t % 32``
    of word ``t // 32``; ids past ``32 * W`` are not allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    allowed = ((bits.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    return allowed[:, :vocab]


def greedy_tokens(logits: torch.Tensor, bits: torch.Tensor | None = None) -> torch.Tensor:
    """``logits.argmax(dim=-1)`` (``[B, vocab]`` -> ``[B] int64``): on CUDA (or where
    :func:`_races_on`) the two-pass Triton kernel ``ops.kernels.argmax.argmax_rows`` (the
    same indices) for fp32/bf16/fp16 logits, else torch. ``bits``: a ``[B, W]`` int32 token
    mask of every row (``TokenMask.bits``), applied first, or None."""
    if ((logits.is_cuda or (bits is not None and _races_on(logits))) and logits.dim() == 2
            and logits.shape[1] > 0
            and logits.dtype in (torch.float32, torch.bfloat16, torch.float16)):
        from latentserve.ops.kernels.argmax import argmax_rows

        return argmax_rows(logits if logits.stride(-1) == 1 else logits.contiguous(),
                           bits=bits)
    if bits is not None:
        logits = logits.clone()
        _apply_bitmask(logits, bits)
    return logits.argmax(dim=-1)


def score_rows(logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """Row i of raw ``logits`` ``[N, vocab]`` scoring ``targets[i]`` (``[N] int64``), packed
    on the logits' device as ``[N, 3 + 2k] float64`` (ids and ranks are exact in float64):
    target, its log-probability (raw log-softmax), its rank, then the top ``k`` ids and their
    log-probabilities. :func:`unpack_scores` reads it. On CUDA two kernels and a ``topk``
    (``ops.kernels.logprobs``: the same values within float32 rounding), else torch."""
    if logits.is_cuda and logits.stride(-1) == 1:
        from latentserve.ops.kernels.logprobs import score_rows_cuda

        return score_rows_cuda(logits, targets, k)
    return score_rows_torch(logits, targets, k)


def score_rows_torch(logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """:func:`score_rows` in torch, on any device (the CPU path)."""
    lsm = torch.log_softmax(logits.float(), dim=-1)
    lp = lsm.gather(1, targets[:, None])
    rank = (lsm > lp).sum(-1, keepdim=True) + 1
    parts = [targets[:, None].double(), lp.double(), rank.double()]
    if k > 0:
        v, i = lsm.topk(min(k, lsm.shape[-1]), dim=-1)
        parts += [i.double(), v.double()]
    return torch.cat(parts, dim=1)


def unpack_scores(scores: torch.Tensor, ks: list[int]) -> list[TokenLogprob]:
    """The ``TokenLogprob`` of each row of :func:`score_rows`'s ``scores``, the top ``ks[i]``
    alternatives for row i (a device tensor is waited for)."""
    rows = scores.tolist()
    k = (scores.shape[1] - 3) // 2
    return [TokenLogprob(int(r[0]), r[1], int(r[2]),
                         [(int(t), v) for t, v in zip(r[3 : 3 + kk], r[3 + k : 3 + k + kk])])
            for r, kk in zip(rows, ks)]


def score_tokens(logits: torch.Tensor, targets: torch.Tensor, ks: list[int]
                 ) -> list[TokenLogprob]:
    """Row i of raw ``logits`` ``[N, vocab]`` scoring ``targets[i]`` (``[N] int64``): its
    log-probability, rank and the top ``ks[i]`` (raw log-softmax); waits for the device."""
    return unpack_scores(score_rows(logits, targets, max(ks)), ks)


def _filtered_probs(logits: torch.Tensor, params) -> torch.Tensor:
    dev = logits.device
    temps = [p.temperature for p in params]
    # one temperature for all (the usual case) is filled on the device: no copy
    logits = logits / (torch.full((1, 1), temps[0], dtype=torch.float32, device=dev)
                       if len(set(temps)) == 1 else to_device(temps, torch.float32, dev)[:, None])
    top_k = [p.top_k for p in params]
    if any(k > 0 for k in top_k):
        vocab = logits.shape[-1]
        k = to_device([k if 0 < k < vocab else vocab for k in top_k], torch.long, dev)
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1)[:, None])
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if any(p.top_p < 1 for p in params):  # decided on the host: no wait for the device
        top_p = to_device([p.top_p for p in params], torch.float32, dev)
        sorted_logits, idx = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Drop a token when the mass before it already reaches p. The first token is always
        # kept, also for a top_p that float32 flushes to 0 (vLLM keeps one too).
        drop = (cum - sorted_logits.softmax(-1)) >= top_p[:, None]
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(1, idx, sorted_logits)
    probs = logits.softmax(-1)
    if any(p.min_p > 0 for p in params):
        min_p = to_device([p.min_p for p in params], torch.float32, dev)
        keep = probs >= min_p[:, None] * probs.max(-1, keepdim=True).values
        probs = torch.where(keep, probs, 0.0)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs
