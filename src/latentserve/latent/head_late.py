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
    batch sampled the row (None: not sampled); ``k`` steps before it, ``may_fire``, ``ended``
    at the cap, ``traced``."""

    vec: tuple
    draw: tuple | None
    rng: Any
    probs: HostFloats | None
    j: int
    entry: dict | None
    lens_p: float | None
    action: Any = None
    k: int = 0
    may_fire: bool = False
    ended: bool = False
    traced: bool = False


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
    actions: list = [None] * len(rows)
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
    states = [reqs[i].state for i in rows]
    open_ = [j for j, h in enumerate(states)  # may take a step
             if h.mode == "prompt" or h.steps < h.max_latent]
    drawn = [j for j in open_ if states[j].mode == "closed_loop"
             and states[j].latent_temperature > 0 and not (
                 tokens is not None and _may_fire(states[j], head.stop_token, True)
                 and tokens[rows[j]] == head.stop_token)]
    rngs: dict[int, Any] = {}
    draws: dict[int, tuple] = {}
    if drawn:
        gens = [reqs[rows[j]].generator for j in drawn]
        rngs = {j: g.get_state() for j, g in zip(drawn, gens) if g is not None}
        with torch.inference_mode():
            at = to_device(drawn, torch.long, sel.device)
            out = head.sample(sel[at], [reqs[rows[j]].state.latent_temperature for j in drawn],
                              gens)
        draws = {j: (out, m) for m, j in enumerate(drawn)}
    injected = [draws.get(j, (vecs, j)) for j in range(len(rows))]
    if getattr(head, "record_latents", False):
        with torch.inference_mode():
            actions = list(torch.stack([t[r] for t, r in injected]).float().cpu())
    entries, lens_p = _trace(head, model, reqs, rows, open_, logits, injected, host)
    out: list = [None] * len(reqs)
    for j, i in enumerate(rows):
        out[i] = Candidate((vecs, j), draws.get(j), rngs.get(j), host, j, entries.get(j),
                           lens_p.get(j), actions[j])
    return out


def _trace(head, model, reqs, rows, open_, logits, injected, host) -> tuple[dict, dict]:
    """Traced rows' ``(j -> trace entry, j -> CoLaR's stop-token probability)``."""
    traced = [j for j, i in enumerate(rows) if reqs[i].params.return_latent_trace]
    if not traced:
        return {}, {}
    lens_p = {}
    if head.stop_token is not None:
        with torch.inference_mode():
            at = torch.tensor([rows[j] for j in traced], device=logits.device)
            p = logits[at].float().softmax(-1)[:, head.stop_token].tolist()
        lens_p = dict(zip(traced, p))
    stepping = [j for j in traced if j in set(open_)]
    if not stepping:
        return {}, lens_p
    with torch.inference_mode():
        stacked = torch.stack([injected[j][0][injected[j][1]] for j in stepping])
    entries = dict(zip(stepping, lens_entries(model, stacked)))
    for j, entry in entries.items():
        entry["stop_prob"] = (None if reqs[rows[j]].state.mode == "prompt"  # no stop decision
                              else host.get(j) if host is not None else lens_p.get(j))
    return entries, lens_p


def _may_fire(h, stop_token: int | None, has_probs: bool) -> bool:
    """Whether ``h``'s stop may fire at its next step: CoLaR's on its sampled stop token,
    a stop head's on its probability (``has_probs``)."""
    return h.use_stop and h.steps >= h.min_latent and (
        h.steps > 0 if stop_token is not None else has_probs)


def decide(req: Req, cand: Candidate, stop_token: int | None):
    """The step ``req`` takes at launch (next input or None), ``cand`` kept as ``late``."""
    h = req.state
    if h.mode == "prompt":
        h.steps, h.end = 1, "prompt"
        if cand.entry is not None:
            req.latent_trace.append(cand.entry)
        return cand.vec
    cand.k, cand.ended = h.steps, h.steps >= h.max_latent
    cand.may_fire = _may_fire(h, stop_token, cand.probs is not None)
    cand.traced = cand.entry is not None and not cand.ended
    h.late = cand
    if cand.ended:
        h.end = "cap"
        return None
    h.steps += 1
    if cand.entry is not None:
        req.latent_trace.append(cand.entry)
    return cand.draw if cand.draw is not None else cand.vec


def snapshot(req: Req) -> None:
    """Keep ``req``'s generator state before sampling when its step may be undone."""
    late = getattr(req.state, "late", None)
    if (late is not None and late.rng is None and late.may_fire and not late.ended
            and req.generator is not None):
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
    if not (cand.may_fire and fired):
        return True
    h.end, h.stop_step = "stop", cand.k
    if cand.ended:
        return True
    if launched:
        req.output_ids.pop()
        req.latent_embeds.pop()
    h.steps = cand.k
    if cand.traced:
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
