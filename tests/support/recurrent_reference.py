"""The eager Huginn and Ouro references (``latentserve.bench.baseline.recurrent_reference``)
with their exit rules: Huginn's upstream exit evaluators and ``semantics="upstream"``, Ouro's
exit pdf and its ``threshold``, ``threshold-approx`` and ``weighted`` readouts.

Design notes: docs/internals.md, "latentserve.bench.baseline.recurrent_reference".
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F

from latentserve.bench.baseline import recurrent_reference as base
from latentserve.bench.baseline.recurrent_reference import _greedy, _LayeredCache


class _FullCache(_LayeredCache):
    """Upstream ``HuginnDynamicCache``'s default ``full`` lookup: only the positions present
    at the index (a missing one is left out of that step's attention)."""

    def _rows(self, idx, slot, n):
        kept = sorted(slot)
        return (torch.stack([slot[p][0] for p in kept]),
                torch.stack([slot[p][1] for p in kept]), kept)


class HuginnReference(base.HuginnReference):
    """``HuginnReference`` with upstream's exit criteria (``generate``'s ``criterion``)."""

    # upstream get_adaptive_exit_evaluator's "auto" thresholds
    AUTO: ClassVar[dict] = {"entropy-diff": 1e-3, "latent-diff": 0.03, "kl": 1e-3,
                            "minp-kl": 1e-5, "argmax-stability": 5, "cosine": 1e-3}

    def _checker(self, x0, pos, cache, crit, thr, min_steps, every):
        """``check(step, x)`` for ``_forward``: upstream's exit evaluator at batch size 1,
        run when ``step >= min_steps and (step - min_steps) % every == 0``."""
        dev, vocab = x0.device, self.sd["lm_head.weight"].shape[0]
        st = {"prev_latent": x0.clone(), "prev_entropy": torch.tensor([100.0], device=dev),
              "prev_logp": torch.full((1, vocab), 1 / vocab, device=dev).log(),
              "argmax": torch.tensor([-1], device=dev), "stable": torch.tensor([0], device=dev)}

        def check(step, x):
            if step < min_steps or (step - min_steps) % every:
                return None
            stop, logits = self._check(crit, thr, x, pos, cache, st, vocab)
            if not stop:
                return None
            return self._predict(x, pos, cache) if logits is None else logits

        return check

    def _check(self, crit, thr, x, pos, cache, st, vocab):
        """Upstream exit evaluators at batch size 1: ``(exit, logits or None)``."""
        if crit == "latent-diff":
            val = ((x - st["prev_latent"]).norm(dim=-1) / x.norm(dim=-1)).mean(dim=-1)
            st["prev_latent"] = x.clone()
            return bool(val < thr), None
        if crit == "cosine":
            cos = ((x * st["prev_latent"]).sum(-1) / x.norm(dim=-1)
                   / st["prev_latent"].norm(dim=-1)).mean()
            st["prev_latent"] = x.clone()
            return bool(1 - cos < thr), None
        logits = self._predict(x, pos, cache)
        last = logits[-1:]
        if crit == "entropy-diff":
            probs = F.softmax(last, dim=-1)
            ent = -torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
            val = (ent - st["prev_entropy"]).abs()
            st["prev_entropy"] = ent
            return bool(val < thr), logits
        if crit in ("kl", "minp-kl"):
            if crit == "kl":
                logp = F.log_softmax(last.float(), dim=-1)
            else:
                probs = F.softmax(last, dim=-1)
                mask = probs < 0.1 * probs.max(dim=-1, keepdim=True)[0]
                probs = probs.clone()
                probs[mask] = 1 / vocab
                logp = (probs / probs.sum(dim=-1, keepdim=True)).log()
            val = F.kl_div(logp, st["prev_logp"], reduction="none", log_target=True).sum(-1)
            st["prev_logp"] = logp
            return bool(val < thr), logits
        if crit == "argmax-stability":
            am = last.argmax(dim=-1)
            st["stable"] = torch.where(am == st["argmax"], st["stable"] + 1, 0)
            st["argmax"] = am
            return bool(st["stable"] >= thr), logits
        raise ValueError(f"unknown criterion {crit!r}")

    @torch.no_grad()
    def generate(self, prompt, max_tokens, num_steps, criterion=None, threshold="auto",
                 min_steps=0, check_every=1, semantics="engine") -> dict:
        """Greedy generation (docs/internals.md). ``semantics``: ``"engine"`` (the prompt
        at full depth, ``do_not_exit_in_prefill``; ``latest-m4`` lookup) or ``"upstream"``
        (upstream ``generate_with_adaptive_compute``'s defaults: the prompt is checked as
        one block, ``token_step_in_sequence == 0`` included, and the cache's ``full``
        lookup leaves positions without K/V at a step out of that step's attention)."""
        if semantics not in ("engine", "upstream"):
            raise ValueError(f"semantics must be 'engine' or 'upstream', got {semantics!r}")
        upstream = semantics == "upstream"
        rule = None
        if criterion not in (None, "none"):
            thr = self.AUTO[criterion] if threshold == "auto" else threshold
            rule = (criterion, thr, min_steps, check_every)
        cache = (_FullCache if upstream else _LayeredCache)(self._same_layer)

        def forward(ids, pos, first):
            check = None
            if rule and (upstream or not first):
                check = self._checker(self.state[pos], pos, cache, *rule)
            return self._forward(ids, pos, cache, num_steps, check)

        return _greedy(forward, prompt, max_tokens, ("iterations",))


class OuroReference(base.OuroReference):
    """``OuroReference`` with the exit pdf and the readouts ``last``, ``threshold``,
    ``threshold-approx`` and ``weighted`` (``generate``'s ``mode``)."""

    def _forward(self, ids, pos, cache, depth, mode, thr, may_stop):
        """``(logits [vocab], iterations, readout step or None, exit pdf of the last
        position)``."""
        head = self.sd["lm_head.weight"]
        hs, gates, rem, cum = [], [], 1.0, 0.0
        for t, h in enumerate(self._steps(ids, pos, cache, depth)):
            hs.append(h)
            gates.append(g := h @ self.sd["model.early_exit_gate.weight"].T
                         + self.sd["model.early_exit_gate.bias"])
            if may_stop and t < depth - 1:  # threshold-approx: stop at the exit step
                lam = torch.sigmoid(g.squeeze(-1))
                cum = cum + lam * rem
                rem = rem * (1 - lam)
                if bool(cum[-1] >= thr):
                    return ((h[-1] @ head.T).float(), t + 1, t,
                            self._exit_pdf(gates)[-1].tolist())
        pdf = self._exit_pdf(gates)
        readout = depth - 1
        if mode in ("threshold", "threshold-approx"):
            mask = torch.cumsum(pdf, dim=-1) >= thr
            exit_steps = torch.argmax(mask.float(), dim=-1)
            exit_steps[~mask.any(dim=-1)] = pdf.shape[-1] - 1
            hidden = torch.stack(hs, dim=1)[torch.arange(len(ids), device=h.device), exit_steps]
            logits = hidden @ head.T
            readout = int(exit_steps[-1])
        elif mode == "weighted":
            logits = sum((hh @ head.T) * pdf[:, t:t + 1] for t, hh in enumerate(hs))
            readout = None
        else:
            logits = hs[-1] @ head.T
        return logits[-1].float(), depth, readout, pdf[-1].tolist()

    @staticmethod
    def _exit_pdf(gates):
        """``[S, steps]`` exit pdf from the gate logits of each step (``[S, 1]`` each), as
        upstream ``OuroForCausalLM.forward``: ``p_i = sigmoid(g_i) * prod_{j<i}(1 -
        sigmoid(g_j))``, the last step takes the remaining mass."""
        pdf, rem = [], torch.ones_like(gates[0].squeeze(-1))
        for i, g in enumerate(gates):
            lam = torch.sigmoid(g.squeeze(-1))
            if i < len(gates) - 1:
                p = lam * rem
                rem = rem * (1.0 - lam)
            else:
                p = rem
            pdf.append(p)
        return torch.stack(pdf, dim=-1)

    @torch.no_grad()
    def generate(self, prompt, max_tokens, depth=None, mode="last", threshold=None) -> dict:
        """Greedy generation; ``{"tokens", "logits", "iterations", "readouts",
        "exit_probs"}`` per token. ``threshold``: 1.0 when None."""
        depth = depth or self.steps
        thr = 1.0 if threshold is None else threshold
        cache = _LayeredCache(self._same_layer)
        return _greedy(lambda ids, pos, first: self._forward(
            ids, pos, cache, depth, mode, thr, not first and mode == "threshold-approx"),
            prompt, max_tokens, ("iterations", "readouts", "exit_probs"))
