"""Overlap scheduling: the host schedules and prepares step k+1 while the device runs step k.

Design notes: docs/internals.md, "latentserve.engine.overlap".
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from latentserve.core import ReqStatus
from latentserve.staging import DeviceToHost

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Launched:
    """A batch whose forward and sampling were launched and whose tokens are not finished.

    ``batch``: the ``ScheduledBatch``; ``latents``: its rows' next latent inputs
    (``Family.latent_inputs``), until :func:`_advance` hands them to the scheduler;
    ``pending``: ``(req, index in output_ids or None, latent step's output, late)`` per
    sampling row (``Scheduler.advance_launched``; empty until then);
    ``tokens``: ``[S] int64`` on the device, row j for the batch's j-th sampling row;
    ``host``: their host copy (pinned on CUDA) and ``event`` the CUDA event after it (None
    on the CPU); ``src``: ``id(req) -> j`` for the next batch's pending input ids;
    ``failed``: ``rid -> error`` for rows whose sampling failed (placeholder token 0),
    failed when the batch finishes."""

    batch: Any
    latents: list | None
    pending: list
    tokens: torch.Tensor
    host: torch.Tensor
    event: Any
    src: dict[int, int]
    failed: dict[str, str]


def eligible(engine) -> bool:
    """Whether ``engine``'s next step may overlap (see the module docstring)."""
    if not engine.config.use_overlap_schedule or not engine.family.overlaps \
            or engine.tp is not None:
        return False
    sched = engine.scheduler
    for queue in (sched.running, sched.waiting):
        for r in queue:
            p = r.params
            if p.logprobs is not None or p.prompt_logprobs is not None or p.has_penalties:
                return False
    return True


def step(engine) -> list:
    """One overlapped engine step: launch the next batch, finish the batch launched by the
    previous step (its outputs are returned; none on the first), then advance the host state
    of the new batch (``Scheduler.advance_launched``) past what that finish settled."""
    prev: Launched | None = engine.inflight
    sched = engine.scheduler
    batch = sched.schedule()
    # NOTE: ``prev`` stays in flight until this batch is launched: when the forward raises,
    # the next step still finishes it, so a request of ``prev`` preempted by this schedule
    # (now waiting, its last id still pending) gets its token instead of feeding -1 later.
    launched = None
    if batch is not None:
        try:
            launched = _launch(engine, batch, prev)
        except BaseException:
            # NOTE: the forward may have replayed a graph, overwriting the buffer that
            # prev's tokens view, before something raised; its pending ids must survive
            try:
                _detach(prev)
            except Exception:
                log.exception("could not restore the in-flight tokens from their host copy")
            raise
    engine.inflight = launched
    try:
        return sched.drain_aborted() if prev is None else finish(engine, prev)
    finally:  # the new batch is on the device whatever finishing the last one raised
        if launched is not None:
            _advance(engine, launched)


def _launch(engine, batch, prev: Launched | None) -> Launched:
    """Run ``batch``'s forward (``prev``'s tokens as its pending ids) and launch its
    sampling, its latent inputs and the tokens' host copy; nothing here waits for the
    device."""
    logits, hidden = engine.runner.run(batch, None if prev is None else (prev.tokens, prev.src))
    logits, reqs = engine._after_forward(batch, logits)
    # NOTE: greedy tokens may be a view of the graph's static buffer (last_greedy). It is
    # read only by the host copy below and, as pending ids, by the next step's input
    # kernel, both queued before the next replay overwrites it (if that step raises,
    # _detach points them at the host copy).
    tokens, failed = _sample(engine, logits, reqs, _known(reqs, prev))
    # rows in their latent phase: the next inputs, on the device (their tokens are not read)
    latents = engine.family.latent_inputs(reqs, logits, hidden, None)
    host, event = _host_copy(tokens, engine.token_copies)
    if event is not None and engine.runner.replayed:  # tokens may view a graph's buffer
        engine.runner.graphs.wait_before_replay(event)
    return Launched(batch, latents, [], tokens, host, event, {}, failed)


def _advance(engine, launched: Launched) -> None:
    """Move the host state past ``launched`` (``Scheduler.advance_launched``, after the
    batch before it was finished) and map its pending ids for the next batch."""
    batch, latents, launched.batch, launched.latents = launched.batch, launched.latents, None, None
    pending = engine.scheduler.advance_launched(batch, latents)
    launched.pending = pending
    launched.src = {id(r): j for j, (r, i, _, _) in enumerate(pending) if i is not None}


def finish(engine, launched: Launched) -> list:
    """Wait for ``launched``'s tokens and finish its requests (``finalize_launched``).
    Its failed rows fail their requests now (``LLMEngine._apply_failures``, on these
    outputs), as the synchronous engine's do on the step that sampled them; not the row of
    a request that finished before it (a discarded row)."""
    if launched.event is not None:
        launched.event.synchronize()
    tokens = launched.host.tolist()
    for req, _, _, _ in launched.pending:
        if req.rid in launched.failed and req.status is not ReqStatus.FINISHED:
            engine._failed[req.rid] = launched.failed[req.rid]
    return engine.scheduler.finalize_launched(launched.pending, tokens)


def _host_copy(tokens: torch.Tensor, ring: DeviceToHost) -> tuple[torch.Tensor, Any]:
    """A host copy of a launched batch's ``tokens``, taken now (before the next replay can
    overwrite a graph's buffer that ``tokens`` may view): on CUDA a non-blocking copy into
    one of ``ring``'s pinned buffers and the event after it, so that waiting for them does
    not wait for the next batch; on the CPU a clone and no event. The host copy stays
    valid for the ring's slots - 1 later copies (the engine reads it on the next step)."""
    return ring.copy(tokens)


def _detach(prev: Launched | None) -> None:
    """After a launch that raised (``_launch``: forward, sampling, host copy): point
    ``prev``'s tokens (the pending ids of a later batch) at its host copy, on their device.
    The forward may have replayed a graph and overwritten the buffer they viewed
    (``ModelRunner.last_greedy``) before something raised."""
    if prev is None:
        return
    if prev.event is not None:
        prev.event.synchronize()
    prev.host = prev.host.clone()  # out of the ring: retried launches take its slots again
    prev.tokens = prev.host.to(prev.tokens.device)


def drain(engine) -> list:
    """Finish the batch in flight, if any (before a synchronous step)."""
    prev, engine.inflight = engine.inflight, None
    return [] if prev is None else finish(engine, prev)


def _known(reqs: list, prev: Launched | None) -> dict | None:
    """``id(req) -> (index in output_ids, token)`` of ``prev``'s rows, for the token masks of
    ``reqs`` (``token_masks.batch_bitmask``: the pending id at that index is that token).
    Only when a mask of ``reqs`` reads tokens (bad words, a grammar) does this wait for
    ``prev``'s tokens, while this batch's forward runs on the device; otherwise None (static
    masks read the answer's length alone)."""
    if prev is None or all(r.constraint is None or r.constraint.static for r in reqs):
        return None
    if prev.event is not None:
        prev.event.synchronize()
    return {id(req): (idx, tok) for (req, idx, _, _), tok
            in zip(prev.pending, prev.host.tolist()) if idx is not None}


def _sample(engine, logits: torch.Tensor, reqs: list, known: dict | None = None
            ) -> tuple[torch.Tensor, dict]:
    """``[S] int64`` tokens on ``logits.device`` without waiting for them, and ``rid ->
    error`` of the failed rows; when the batched sampler raises, the engine's row-by-row
    fallback (which isolates a failing request; its failures are taken back from
    ``engine._failed`` and kept with the batch until it finishes). ``known``: see
    :func:`_known`."""
    from latentserve.sampling import sample_with_logprobs

    if not reqs:
        return torch.empty(0, dtype=torch.int64, device=logits.device), {}
    mask = engine.token_mask(reqs, logits.device, known)
    try:
        return sample_with_logprobs(logits, reqs, greedy=engine.runner.last_greedy,
                                    mask=mask).tokens, {}
    except Exception:  # noqa: BLE001 - the fallback below names the failing rows
        tokens, _ = engine._sample(logits, reqs, mask=mask)
        failed = {r.rid: engine._failed.pop(r.rid) for r in reqs if r.rid in engine._failed}
        return torch.tensor(tokens, dtype=torch.int64, device=logits.device), failed
