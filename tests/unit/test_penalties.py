"""``sampling.apply_penalties`` against a row-by-row reading of vLLM's rules, with the
pieces overlap scheduling adds: a trailing ``PENDING_ID`` in the answer is not counted, and
the token the device still holds for it (``pending``) is."""

import random

import pytest
import torch

from latentserve.sampling import apply_penalties
from latentserve.sampling_params import SamplingParams
from latentserve.scheduler.scheduler import PENDING_ID

VOCAB = 300


class _Req:
    def __init__(self, prompt_ids, answer_ids, params):
        self.prompt_ids, self.answer_ids, self.params = prompt_ids, answer_ids, params


def _reference(logits: torch.Tensor, reqs) -> torch.Tensor:
    """Row by row: repetition on the prompt and answer, then frequency and presence on the
    answer (vLLM's ``apply_penalties``)."""
    out = logits.clone()
    for i, r in enumerate(reqs):
        p, counts = r.params, torch.zeros(VOCAB)
        for t in r.answer_ids:
            counts[t] += 1
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[r.prompt_ids] = True
            x = out[i]
            out[i] = torch.where(seen, torch.where(x > 0, x / p.repetition_penalty,
                                                   x * p.repetition_penalty), x)
        out[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
    return out


@pytest.mark.parametrize("seed", range(8))
def test_penalties_count_the_pending_token_from_the_device(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 6)
    reqs, full, pending = [], [], []
    for _ in range(n):
        answer = [rng.randrange(VOCAB) for _ in range(rng.randint(0, 20))]
        tok = rng.choice([-1, rng.randrange(VOCAB)])  # -1: nothing pending for this row
        params = SamplingParams(presence_penalty=rng.choice([0.0, 0.5, -1.5]),
                                frequency_penalty=rng.choice([0.0, 1.0]),
                                repetition_penalty=rng.choice([1.0, 1.3, 0.7]))
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 10))]
        reqs.append(_Req(prompt, answer + ([PENDING_ID] if tok >= 0 else []), params))
        full.append(_Req(prompt, answer + ([tok] if tok >= 0 else []), params))
        pending.append(tok)
    logits = torch.randn(n, VOCAB)
    want = _reference(logits, full)
    torch.testing.assert_close(apply_penalties(logits, reqs, torch.tensor(pending)), want)
    torch.testing.assert_close(apply_penalties(logits, full), want)  # the synchronous step
