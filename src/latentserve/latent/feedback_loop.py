"""Feedback latents at serving time (COCONUT, CODI, SIM-CoT): each latent step feeds the last hidden
(through ``model.latent_feedback``) back as the next input embedding. Sources: COCONUT arXiv
2412.06769 (``coconut.py``), CODI arXiv 2502.21074 (``test.py``)."""

from __future__ import annotations

from dataclasses import replace

import torch

from latentserve.core import Req
from latentserve.latent.family import BudgetedFamily, GraphHooks
from latentserve.latent.lens import lens_entries
from latentserve.staging import to_device


class FeedbackFamily(BudgetedFamily):
    description = "a feedback-latent model"

    @staticmethod
    def graph_hooks(spec, model, max_bs, device) -> GraphHooks:
        """``model.latent_feedback`` in the decode graphs unless it is the identity (COCONUT):
        CODI's ``prj`` runs there beside the LM head."""
        hooks = GraphHooks()
        feedback = getattr(model, "latent_feedback", None)
        if feedback is not None and not isinstance(feedback, torch.nn.Identity):
            hooks.feedback = feedback
        return hooks

    def cap_thinking(self, params):
        """One latent position a step: ``latent_budget`` at most ``thinking_token_budget``."""
        budget = self.spec.resolve_budget(params.latent_budget)
        return replace(params, latent_budget=min(budget, params.thinking_token_budget))

    def advance(self, req: Req, vec) -> bool:
        """Append the next latent position (input ``vec``) while budget remains, else the
        end ids; True when there are none."""
        spec = self.spec
        if len(req.latent_embeds) < req.latent_budget:
            req.latent_embeds.append(vec)
            req.output_ids.append(spec.latent_id)
            return False
        req.output_ids.extend(spec.end_ids)
        req.answer_start = len(req.output_ids)
        return not spec.end_ids

    def latent_inputs(self, reqs, logits, last_hidden, tokens) -> list | None:
        """The feedback hook, batched on the thinking rows (a graph replay ran it already);
        records the lens trace of requests that asked."""
        rows = [i for i, r in enumerate(reqs) if self.thinking(r)]
        if not rows:
            return None
        runner = self.engine.runner
        model = runner.model
        every = len(rows) == len(reqs)  # every row thinks (the common latent decode batch)
        with torch.inference_mode():
            pre = runner.latent_outputs()  # CODI's prj in the replayed graph (a static buffer)
            src = last_hidden if pre is None else pre
            sel = src if every else src[to_device(rows, torch.long, src.device)]
            vecs = sel if pre is not None else model.latent_feedback(sel)
            if runner.replayed and (vecs.untyped_storage().data_ptr()
                                    == src.untyped_storage().data_ptr()):
                vecs = vecs.clone()  # a graph's static output (COCONUT: the identity)
        traced = [j for j, i in enumerate(rows) if reqs[i].params.return_latent_trace]
        if traced:
            sel = vecs[torch.tensor(traced, device=vecs.device)]
            for j, entry in zip(traced, lens_entries(model, sel)):
                reqs[rows[j]].latent_trace.append(entry)
        pos = {i: j for j, i in enumerate(rows)}
        return [(vecs, pos[i]) if i in pos else None for i in range(len(reqs))]
