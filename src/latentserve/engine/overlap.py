"""Overlap scheduling: the host prepares step k+1 while the device runs step k
(docs/internals.md)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from latentserve import sampling, token_masks  # by module: tests patch what the engine calls
from latentserve.core import ReqStatus
from latentserve.outputs import attach_logprobs
from latentserve.staging import DeviceToHost, to_device

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Launched:
    """A launched batch whose tokens are not finished: ``latents``, ``pending``
    (``Scheduler.advance_launched``), ``tokens`` ``[S] int64`` on the device, ``host`` /
    ``event`` (None on the CPU), ``src`` (``id(req) -> j``), ``failed`` (``rid -> error``),
    ``logprobs`` (None: no row asked; else returns the ``S`` rows' ``TokenLogprob`` or None,
    waiting for their copy)."""

    batch: Any
    latents: list | None
    pending: list
    tokens: torch.Tensor
    host: torch.Tensor
    event: Any
    src: dict[int, int]
    failed: dict[str, str]
    logprobs: Callable[[], list] | None = None


def eligible(engine) -> bool:
    """Whether ``engine``'s next step may overlap: overlap scheduling on and a family that
    overlaps (``Family.overlaps``)."""
    return engine.config.use_overlap_schedule and engine.family.overlaps


def step(engine) -> list:
    """Launch the next batch, finish (and return the outputs of) the one launched before,
    then advance the new batch's host state (``Scheduler.advance_launched``)."""
    prev: Launched | None = engine.inflight
    sched = engine.scheduler
    batch = sched.schedule()
    # NOTE: ``prev`` stays in flight until this batch is launched: if the forward raises, the
    # next step still finishes it (a preempted request of ``prev`` gets its token).
    launched = None
    if batch is not None:
        try:
            launched = _launch(engine, batch, prev)
        except BaseException:
            # NOTE: the forward may have replayed a graph, overwriting the buffer that
            # prev's tokens view, before something raised; its pending ids must survive: point
            # them at their host copy, out of the ring (retried launches take its slots again)
            try:
                if prev is not None:
                    if prev.event is not None:
                        prev.event.synchronize()
                    prev.host = prev.host.clone()
                    prev.tokens = prev.host.to(prev.tokens.device)
            except Exception:
                log.exception("could not restore the in-flight tokens from their host copy")
            raise
    engine.inflight = launched
    try:
        return sched.drain_aborted() if prev is None else finish(engine, prev)
    finally:  # the new batch is on the device whatever finishing the last one raised
        if launched is not None:  # advance its host state; map its pending ids
            latents, launched.batch, launched.latents = launched.latents, None, None
            launched.pending = sched.advance_launched(batch, latents)
            launched.src = {id(r): j for j, (r, i, _, _) in enumerate(launched.pending)
                            if i is not None}


def _launch(engine, batch, prev: Launched | None) -> Launched:
    """Launch ``batch``'s forward (``prev``'s tokens as its pending ids), sampling, latent
    inputs and host copy without waiting for the device; the token masks' grammars fill
    beside the forward launch when ``prev``'s tokens are on the host already."""
    _count_penalties(engine, batch, prev)
    begun, known = _begin_mask(engine, batch, prev)
    try:
        logits, hidden = engine.runner.run(batch,
                                           None if prev is None else (prev.tokens, prev.src))
        if engine.runner.prompt_hidden:  # prompt logprobs: waits for this forward
            engine.prompt_logprobs.record(engine.runner.model, engine.runner.prompt_hidden)
        reqs = engine._after_forward(batch)
        if begun is None:
            known = _known(reqs, prev)
        # NOTE: greedy tokens may view a graph's static buffer (last_greedy), read only by
        # the host copy and the next step's input kernel, both queued before the next replay.
        tokens, logprobs, failed = _sample(engine, logits, reqs, known, begun)
    except BaseException:
        token_masks.settle(begun)
        raise
    # rows in their latent phase: the next inputs, on the device (their tokens are not read)
    latents = engine.family.latent_inputs(reqs, logits, hidden, None)
    host, event = _host_copy(tokens, engine.token_copies)
    if event is not None and engine.runner.replayed:  # tokens may view a graph's buffer
        engine.runner.graphs.wait_before_replay(event)
    return Launched(batch, latents, [], tokens, host, event, {}, failed, logprobs)


def _begin_mask(engine, batch, prev: Launched | None) -> tuple[Any, dict | None]:
    """``(LLMEngine.begin_token_mask's result, known)`` for ``batch``'s sampling rows when
    their masks read tokens and ``prev``'s are on the host already (a host-bound step:
    checked without waiting); ``(None, None)`` otherwise: the masks wait for the forward's
    launch. O(1) while no live request has a grammar."""
    if not engine._grammar_rids:
        return None, None
    if prev is not None and prev.event is not None and not prev.event.query():
        return None, None
    reqs = [r for r, s in zip(batch.reqs, batch.sample) if s]
    known = _known(reqs, prev)
    return engine.begin_token_mask(reqs, known), known


def finish(engine, launched: Launched) -> list:
    """Wait for ``launched``'s tokens and finish its requests (``finalize_launched``); its
    failed rows fail their requests (not a discarded row's)."""
    if launched.event is not None:
        launched.event.synchronize()
    tokens = launched.host.tolist()
    for req, _, _, _ in launched.pending:
        if req.rid in launched.failed and req.status is not ReqStatus.FINISHED:
            engine._failed[req.rid] = launched.failed[req.rid]
    outs = engine.scheduler.finalize_launched(launched.pending, tokens)
    if launched.logprobs is not None:  # one pending entry per sampled row, in row order
        attach_logprobs(outs, [r.rid for r, _, _, _ in launched.pending], launched.logprobs())
    return outs


def _host_copy(tokens: torch.Tensor, ring: DeviceToHost) -> tuple[torch.Tensor, Any]:
    """``(host copy, event)`` of ``tokens`` before the next replay can overwrite a graph
    buffer they view (a seam: tests and scripts/host_probe.py patch it)."""
    return ring.copy(tokens)


def _known(reqs: list, prev: Launched | None) -> dict | None:
    """``id(req) -> (index in output_ids, token)`` of ``prev``'s rows for the token masks
    of ``reqs``; waits for them only when a mask reads tokens (else None)."""
    if prev is None or all(r.constraint is None or r.constraint.static for r in reqs):
        return None
    if prev.event is not None:
        prev.event.synchronize()
    return {id(req): (idx, tok) for (req, idx, _, _), tok
            in zip(prev.pending, prev.host.tolist()) if idx is not None}


def _count_penalties(engine, batch, prev: Launched | None) -> None:
    """Count the answer tokens that ``batch``'s rows with penalties gained
    (``PenaltyCounts.count``), the one ``prev`` still holds on the device among them; queued
    before ``batch``'s forward, whose replay may overwrite the graph buffer that
    ``prev.tokens`` views."""
    if not engine.penalties.live:  # O(1) on the usual step
        return
    reqs = [r for r, s in zip(batch.reqs, batch.sample) if s]
    if prev is None:
        engine.penalties.count(reqs)
    else:
        engine.penalties.count(reqs, prev.src, prev.pending, prev.tokens)


def _sample(engine, logits: torch.Tensor, reqs: list, known: dict | None = None,
            begun=None) -> tuple[torch.Tensor, Callable[[], list] | None, dict]:
    """``([S] int64 tokens on the device, the logprobs' reader or None, rid -> error of
    failed rows)``, not waited for (the logprobs are copied to the host beside the tokens);
    the engine's row-by-row fallback when the batched sampler raises. ``begun``: see
    ``LLMEngine.token_mask``."""
    if not reqs:
        token_masks.settle(begun)
        return torch.empty(0, dtype=torch.int64, device=logits.device), None, {}
    mask = engine.token_mask(reqs, logits.device, known, begun)
    bias = engine.logit_bias(reqs, logits.device)
    try:
        res = sampling.sample_with_logprobs(logits, reqs, greedy=engine.runner.last_greedy,
                                            mask=mask, bias=bias, penalties=engine.penalties)
    except Exception:  # noqa: BLE001 - the fallback below names the failing rows
        res = None
    if res is None:  # outside the except: the fallback's own logs chain no traceback
        tokens, logprobs = engine._sample(logits, reqs, mask=mask, bias=bias)
        failed = {r.rid: engine._failed.pop(r.rid) for r in reqs if r.rid in engine._failed}
        known_lps = (lambda: logprobs) if any(lp is not None for lp in logprobs) else None
        return to_device(tokens, torch.int64, logits.device), known_lps, failed
    if res.scores is None:
        return res.tokens, None, {}
    shape = res.scores.shape
    host, event = engine.score_copies.copy(res.scores.view(torch.int64).reshape(-1))
    res.scores = None  # the device copy is not kept

    def read() -> list:
        if event is not None:
            event.synchronize()
        return res.read(host.view(torch.float64).view(shape))

    return res.tokens, read, {}
