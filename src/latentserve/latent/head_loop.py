"""The compression head's per-request phase machine, closed loop and prompt mode
(docs/internals.md)."""

from __future__ import annotations

import dataclasses

from latentserve.core import Req
from latentserve.latent.family import Admission, Family
from latentserve.latent.head import (
    CONTROLS,
    apply_output_floor,
    head_defaults,
    refuse_controls,
    resolve_settings,
)
from latentserve.latent.head_late import Candidate, candidates, decide, settle, snapshot, step_now
from latentserve.staging import DeviceToHost


def set_policy_sampling(head, sigma: float | None = None, *, record: bool = False) -> None:
    """GRPO rollout options on ``head``: ``sigma`` > 0 injects ``decode(z)``, ``z ~ N(mu,
    sigma^2 I)``, recording ``(anchor, z)``; 0: ``mu``, recorded; None: MAP. ``record``
    (CoLaR): record each injected input. Raises ValueError for sigma < 0 or both."""
    if sigma is not None and not sigma >= 0:
        raise ValueError(f"sigma must be >= 0 (or None to use mu), got {sigma!r}")
    if record and sigma is not None:
        raise ValueError("record=True records the injected inputs of a head that draws its own "
                         "latents; with sigma the (anchor, z) actions are recorded already")
    head.policy_sigma = None if sigma is None else float(sigma)
    head.record_latents = bool(record)


class HeadFamily(Family):
    """The ``Family`` of compression-head models: :meth:`admit`, the latent steps of
    ``latent/head_late.py``."""

    decides_late = traced = streams_steps = takes_head_controls = True
    traced_under_tp = False
    description = "a compression-head model"

    @property
    def overlaps(self) -> bool:
        """Not while GRPO rollouts draw or record policy latents (``set_policy_sampling``)."""
        head = self.engine.runner.model.latent_head
        return (getattr(head, "policy_sigma", None) is None
                and not getattr(head, "record_latents", False))

    def setup(self) -> None:
        self.defaults = head_defaults()
        runner = self.engine.runner
        runner.capture_layer = runner.model.latent_head.capture_layer  # -1: final-normed hidden
        self._probs = DeviceToHost()  # stop probabilities to the host
        self._stop_token = runner.model.latent_head.stop_token  # fixed per model

    def cap_thinking(self, params):
        """``head.resolve_settings`` holds ``max_latent`` to ``thinking_token_budget``."""
        return params

    def admit(self, prompt_ids, params) -> Admission:
        """The head's own ``prepare_request`` (CoLaR), else the compression head's controls,
        ``max_tokens`` raised by the output floor. Raises ValueError naming a bad control."""
        model, spec = self.engine.runner.model, self.spec
        own = getattr(model.latent_head, "prepare_request", None)
        if own is not None:
            params, hs, start_ids = own(prompt_ids, params)
            if hs.thinking:  # CoLaR: a cap past the context ends with length, as vLLM's
                self._fit_context(hs, len(prompt_ids) + len(start_ids), True, hold=False)
        else:
            refuse_controls(params, CONTROLS, "a compression head")
            hs = resolve_settings(params, self.defaults, model.latent_head_mode,
                                  model.latent_head.has_stop)
            hs.end_ids = spec.end_ids if hs.mode == "closed_loop" else ()
            k, start_ids = len(spec.start_ids), ()
            if hs.thinking and list(prompt_ids[-k:]) != list(spec.start_ids):
                start_ids = spec.start_ids
            if hs.thinking and hs.mode == "closed_loop":
                self._fit_context(hs, len(prompt_ids) + len(start_ids),
                                  params.min_latent is not None)
            if hs.thinking:
                cap = hs.max_latent if hs.mode == "closed_loop" else 0
                floor = apply_output_floor(params.max_tokens, hs.min_output_tokens, cap)
                if floor != params.max_tokens:
                    params = dataclasses.replace(params, max_tokens=floor)

        def start(req: Req) -> None:
            req.state = hs
            req.prompt_ids += start_ids
            if hs.thinking:
                req.latent_start, req.answer_start = len(req.prompt_ids), None

        return Admission(params, len(start_ids) + (len(hs.end_ids) if hs.thinking else 0),
                         start)

    def _fit_context(self, hs, n: int, floor_sent: bool, hold: bool = True) -> None:
        """With ``hold``, hold ``hs.max_latent`` to the latent steps that leave room, after
        a prompt of ``n`` positions, for the closing ids and one answer token; the server's
        default floor yields to it too. ValueError when a sent ``hs.min_latent``
        (``floor_sent``) does not fit (a prompt too long for any is the engine's error)."""
        room = self.engine.max_model_len - n - len(hs.end_ids) - 1
        if room < 0:
            return
        if hold and not floor_sent:
            hs.min_latent = min(hs.min_latent, room)
        if hs.min_latent > room:
            raise ValueError(f"min_latent must be at most {room} for this prompt: its {n} "
                             f"positions, the closing ids and one answer token leave room for "
                             f"{room} latent steps in max_model_len {self.engine.max_model_len},"
                             f" got {hs.min_latent}")
        if hold:
            hs.max_latent = min(hs.max_latent, room)

    def thinking(self, req: Req) -> bool:
        return req.answer_start is None and req.state is not None

    def after_forward(self, batch) -> None:
        """Overlap mode: keep the generator state of a row that may be undone."""
        for req, sample in zip(batch.reqs, batch.sample):
            if sample and req.generator is not None and req.state is not None:
                snapshot(req, self._stop_token)

    def advance(self, req: Req, vec) -> bool:
        """``vec``: the next input (or a ``head_late.Candidate``), None: closing ids forced.
        Prompt mode: the last prompt position's input, which is recomputed."""
        if isinstance(vec, Candidate):
            vec = decide(req, vec, self._stop_token)
        if req.state.mode == "prompt":
            req.latent_start = len(req.prompt_ids) - 1
            req.latent_embeds = [vec]
            req.num_computed = req.latent_start
            req.answer_start = len(req.output_ids)
            return False
        if vec is not None:
            req.latent_embeds.append(vec)
            req.output_ids.append(self.spec.latent_id)
            return False
        req.output_ids.extend(req.state.end_ids)
        req.answer_start = len(req.output_ids)
        return not req.state.end_ids

    def resolve(self, req: Req, token: int) -> bool:
        return settle(req, token, self._stop_token)

    def budget_spent(self, req: Req, max_model_len: int) -> str | None:
        """"length" when the phase spent ``max_tokens`` or left no room for the closing ids."""
        h = req.state
        if h is None or (req.answer_start is not None and h.mode == "prompt"):
            return None
        closing = len(h.end_ids) if req.answer_start is None else 0  # still to come
        spent = not h.answer_budget and len(req.output_ids) >= req.params.max_tokens
        if spent or req.seq_len + closing >= max_model_len:
            h.end = h.end or "length"
            return "length"
        return None

    def latents_count_as_output(self, req: Req) -> bool:
        return req.state is not None and not req.state.answer_budget

    def output_fields(self, req: Req, done: bool) -> dict:
        """Latent steps, and the head's stats once settled and on the final output."""
        fields = super().output_fields(req, done)
        h = req.state
        if h is not None and (done or (h.settled and not h.reported)):
            h.reported = True
            fields["latent_stats"] = h.stats()
        return fields

    def latent_inputs(self, reqs, logits, last_hidden, tokens) -> list | None:
        """Per row a ``head_late.Candidate`` (overlap mode: ``tokens`` None) or its next
        input (``head_late.step_now``); None when no row is in its latent phase."""
        runner = self.engine.runner
        head = runner.model.latent_head
        anchors = runner.last_captured if runner.capture_layer >= 0 else last_hidden
        out = candidates(head, runner.model, reqs, logits, anchors, runner.latent_outputs,
                         self._probs, tokens)
        if tokens is None or out is None:
            return out
        return [c if c is None else step_now(reqs[i], c, tokens[i], head.stop_token)
                for i, c in enumerate(out)]
