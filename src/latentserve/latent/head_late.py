"""A compression head's latent step: decided at launch, settled when its sampled token and
stop probability reach the host (overlap scheduler), or both at once (:func:`step_now`;
docs/internals.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from latentserve.core import Req
from latentserve.latent.lens import lens_entries
from latentserve.staging import to_device


class HostFloats:
    """``[n] float32`` device values copied to the host through an int64 ``DeviceToHost``
    ring; :meth:`get` waits for the copy once."""

    def __init__(self, values: torch.Tensor, ring):
        bits = values.detach().float().contiguous().view(torch.int32).to(torch.int64)
        self._host, self._event = ring.copy(bits)
        self._values: list[float] | None = None

    def get(self, j: int) -> float:
        if self._values is None:
            if self._event is not None:
                self._event.synchronize()
            self._values = self._host.to(torch.int32).view(torch.float32).tolist()
        return self._values[j]


@dataclass(slots=True)
class Candidate:
    """A latent-phase row's launch, then (:func:`decide`) its decision until settled: ``vec``
    / ``draw`` ``(tensor, row)`` entries, stop ``probs`` at row ``j``, trace ``entry``,
    CoLaR's ``lens_p``, ``action`` (float32 CPU: ``(anchor [H], z [L])`` with sigma set, the
    injected input ``[H]`` when recorded); ``rng`` before the draw, else before the next
    batch sampled the row (None: not sampled); ``k`` steps before it, ``ended`` at the cap."""

    vec: tuple
    probs: HostFloats | None
    j: int
    draw: tuple | None = None
    rng: Any = None
    entry: dict | None = None
    lens_p: float | None = None
    action: Any = None
    k: int = 0
    ended: bool = False


def candidates(head, model, reqs: list[Req], logits: torch.Tensor, anchors: torch.Tensor,
               precomputed, ring, tokens: list[int] | None = None) -> list | None:
    """Per sampling row its :class:`Candidate` or None; None when no row is in its phase.
    ``anchors``: ``[S, hidden]``; ``precomputed``: a CUDA graph's ``(vecs [S, H], probs)`` or
    a callable giving them; ``tokens`` (synchronous): the sampled ids, a row whose sampled
    stop token ends its phase draws nothing. ``head.policy_sigma`` (``set_policy_sampling``):
    inputs ``decode(z)``, ``z ~ N(mu, sigma^2 I)``, action ``(anchor, z)``;
    ``head.record_latents``: action the injected input. Changes no request state."""
    sigma = getattr(head, "policy_sigma", None)
    rows = [i for i, r in enumerate(reqs) if r.state is not None and r.answer_start is None]
    if not rows:
        return None
    every = len(rows) == len(reqs)  # no index ops when every row is in the phase
    idx = None if every else to_device(rows, torch.long, anchors.device)
    pre = None if sigma is not None else precomputed() if callable(precomputed) else precomputed
    actions = None
    with torch.inference_mode():
        sel = anchors if every else anchors[idx]
        if sigma is not None:
            mu, probs = head.encode(sel), head.stop_prob(sel)
            z = mu + sigma * torch.randn_like(mu) if sigma > 0 else mu
            vecs = head.decode(z)
            actions = list(zip(sel.float().cpu(), z.float().cpu()))
        elif pre is not None:  # a CUDA graph ran the head on these anchors (static buffers)
            vecs = pre[0].clone() if every else pre[0][idx]
            probs = pre[1] if pre[1] is None or every else pre[1][idx]
        else:
            vecs, probs = head.serve_outputs(sel)
    host = HostFloats(probs, ring) if probs is not None else None
    cands = [Candidate((vecs, j), host, j) for j in range(len(rows))]
    if actions is not None or getattr(head, "record_latents", False) or _extra_rows(reqs, rows):
        _add_extras(head, model, reqs, rows, sel, logits, tokens, cands, actions)
    if every:
        return cands
    out: list = [None] * len(reqs)
    for i, cand in zip(rows, cands):
        out[i] = cand
    return out


def _extra_rows(reqs: list[Req], rows: list[int]) -> bool:
    """Whether a row of ``rows`` may draw its input (``latent_temperature`` > 0) or is traced;
    without one, and without policy actions, :func:`_add_extras` has nothing to set."""
    return any([reqs[i].state.latent_temperature > 0 or reqs[i].params.return_latent_trace
                for i in rows])


def _add_extras(head, model, reqs, rows, sel, logits, tokens, cands, actions) -> None:
    """Set what only some candidates have, ``cands`` one per row of ``rows``: ``draw`` and
    ``rng`` (open closed-loop rows with ``latent_temperature`` > 0 draw their input from their
    anchor in ``sel`` ``[len(rows), hidden]``), ``action`` (``actions``, else the injected
    input with ``head.record_latents``) and the trace's ``entry`` / ``lens_p``."""
    stop = head.stop_token
    states = [reqs[i].state for i in rows]
    open_ = [j for j, h in enumerate(states)  # may take a step
             if h.mode == "prompt" or h.steps < h.max_latent]
    drawn = [j for j in open_ if states[j].mode == "closed_loop"
             and states[j].latent_temperature > 0 and not (
                 tokens is not None and _may_fire(states[j], states[j].steps, stop, True)
                 and tokens[rows[j]] == stop)]
    if drawn:
        gens = [reqs[rows[j]].generator for j in drawn]
        for j, g in zip(drawn, gens):
            if g is not None:
                cands[j].rng = g.get_state()
        with torch.inference_mode():
            at = to_device(drawn, torch.long, sel.device)
            out = head.sample(sel[at], [states[j].latent_temperature for j in drawn], gens)
        for m, j in enumerate(drawn):
            cands[j].draw = (out, m)
    if getattr(head, "record_latents", False):
        with torch.inference_mode():
            actions = list(torch.stack([_input(c) for c in cands]).float().cpu())
    if actions is not None:
        for cand, action in zip(cands, actions):
            cand.action = action
    _trace(head, model, reqs, rows, open_, logits, cands)


def _input(cand: Candidate) -> torch.Tensor:
    """The ``[hidden]`` input ``cand`` injects when it steps: its draw, else its ``vec``."""
    t, r = cand.vec if cand.draw is None else cand.draw
    return t[r]


def _trace(head, model, reqs, rows, open_, logits, cands) -> None:
    """Set traced rows' CoLaR stop-token probability ``lens_p`` and, on those that may take a
    step (``open_``), their trace ``entry``."""
    traced = [j for j, i in enumerate(rows) if reqs[i].params.return_latent_trace]
    if not traced:
        return
    if head.stop_token is not None:
        with torch.inference_mode():
            at = torch.tensor([rows[j] for j in traced], device=logits.device)
            p = logits[at].float().softmax(-1)[:, head.stop_token].tolist()
        for j, pj in zip(traced, p):
            cands[j].lens_p = pj
    stepping = [j for j in traced if j in set(open_)]
    if not stepping:
        return
    with torch.inference_mode():
        stacked = torch.stack([_input(cands[j]) for j in stepping])
    for j, entry in zip(stepping, lens_entries(model, stacked)):
        cand = cands[j]
        entry["stop_prob"] = (None if reqs[rows[j]].state.mode == "prompt"  # no stop decision
                              else cand.probs.get(j) if cand.probs is not None else cand.lens_p)
        cand.entry = entry


def _may_fire(h, steps: int, stop_token: int | None, has_probs: bool) -> bool:
    """Whether ``h``'s stop may fire at the step taken after ``steps`` steps: CoLaR's on its
    sampled stop token, a stop head's on its probability (``has_probs``)."""
    return h.use_stop and steps >= h.min_latent and (
        steps > 0 if stop_token is not None else has_probs)


def decide(req: Req, cand: Candidate, stop_token: int | None):
    """The step ``req`` takes at launch (next input or None), ``cand`` kept as ``late``."""
    h = req.state
    if h.mode == "prompt":
        h.steps, h.end = 1, "prompt"
        if cand.entry is not None:
            req.latent_trace.append(cand.entry)
        return cand.vec
    cand.k = h.steps
    h.late = cand
    if h.steps >= h.max_latent:
        cand.ended, h.end = True, "cap"
        return None
    h.steps += 1
    if cand.entry is not None:
        req.latent_trace.append(cand.entry)
    return cand.draw if cand.draw is not None else cand.vec


def snapshot(req: Req, stop_token: int | None) -> None:
    """Keep ``req``'s generator state before sampling when its step may be undone."""
    late = getattr(req.state, "late", None)
    if (late is not None and late.rng is None and not late.ended and req.generator is not None
            and _may_fire(req.state, late.k, stop_token, late.probs is not None)):
        late.rng = req.generator.get_state()


def settle(req: Req, token: int, stop_token: int | None, launched: bool = True) -> bool:
    """Settle ``req``'s ``late`` decision; False when a fired stop undid the step
    (``launched``: ``advance`` had taken it)."""
    h = req.state
    cand = getattr(h, "late", None)
    if cand is None:
        return True
    h.late = None
    if cand.lens_p is not None:
        h.last_stop_prob = cand.lens_p
    p = cand.probs.get(cand.j) if cand.probs is not None else None
    if p is not None:
        h.max_stop_prob = p if h.max_stop_prob is None else max(h.max_stop_prob, p)
        h.last_stop_prob = p
    # the stop head's probability, or CoLaR's sampled stop token
    fired = token == stop_token if stop_token is not None else (
        p is not None and p > h.stop_threshold)
    if not (fired and _may_fire(h, cand.k, stop_token, cand.probs is not None)):
        return True
    h.end, h.stop_step = "stop", cand.k
    if cand.ended:
        return True
    if launched:
        req.output_ids.pop()
        req.latent_embeds.pop()
    h.steps = cand.k
    if cand.entry is not None:  # decide appended it
        req.latent_trace.pop()
    if cand.rng is not None:
        req.generator.set_state(cand.rng)
    return False


def step_now(req: Req, cand: Candidate, token: int, stop_token: int | None):
    """The synchronous schedule's step: :func:`decide` settled at once with the sampled
    ``token``; the next input or None (the phase ended), the policy's action recorded."""
    vec = decide(req, cand, stop_token)
    if not settle(req, token, stop_token, launched=False):
        return None
    h = req.state
    if vec is not None and cand.action is not None and h.mode == "closed_loop":
        h.actions = h.actions or []
        h.actions.append(cand.action)
    return vec
