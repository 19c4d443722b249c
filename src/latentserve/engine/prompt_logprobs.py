"""Prompt logprobs (``SamplingParams.prompt_logprobs``): each prompt token's log-probability
given the ones before it, from ``ModelRunner.prompt_hidden`` as the chunks run."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from latentserve.outputs import StepOutput, TokenLogprob
from latentserve.sampling import score_tokens

# Rows turned into [rows, vocab] logits at once (bounds the memory of a long prompt chunk).
_LOGIT_ROWS = 256


@dataclass(slots=True)
class _Entry:
    k: int
    lps: list[TokenLogprob | None]
    missing: int  # logprobs not yet scored (the first prompt token has none)


class PromptLogprobTracker:
    """Prompt logprobs of the running requests that asked, by request id."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def __bool__(self) -> bool:
        return bool(self._entries)

    def add(self, rid: str, num_prompt_tokens: int, k: int) -> None:
        """Track ``rid``: the first ``num_prompt_tokens`` prompt tokens (the client's prompt,
        before any latent start ids) with ``k`` top alternatives each."""
        self._entries[rid] = _Entry(k, [None] * num_prompt_tokens, num_prompt_tokens - 1)

    @torch.inference_mode()
    def record(self, model, prompt_hidden: list) -> None:
        """Score one forward's ``(req, start, hidden [q_len, hidden_size])``: row i predicts
        the prompt token at ``start + i + 1``."""
        for req, start, hidden in prompt_hidden:
            entry = self._entries.get(req.rid)
            if entry is None:
                continue
            m = min(len(hidden), len(entry.lps) - 1 - start)
            for lo in range(0, max(m, 0), _LOGIT_ROWS):
                hi = min(m, lo + _LOGIT_ROWS)
                targets = torch.tensor(req.prompt_ids[start + 1 + lo : start + 1 + hi],
                                       device=hidden.device)
                scored = score_tokens(model.compute_logits(hidden[lo:hi]), targets,
                                      [entry.k] * (hi - lo))
                for i, lp in enumerate(scored, start=start + 1 + lo):
                    if entry.lps[i] is None:
                        entry.lps[i] = lp
                        entry.missing -= 1

    def attach(self, outs: list[StepOutput]) -> None:
        """Put each complete list on its request's output in ``outs`` (once); forget
        requests that finish (an aborted request may never complete its prompt)."""
        for o in outs:
            entry = self._entries.get(o.rid)
            if entry is not None and (entry.missing == 0 or o.finished):
                if entry.missing == 0:
                    o.prompt_logprobs = entry.lps
                del self._entries[o.rid]
