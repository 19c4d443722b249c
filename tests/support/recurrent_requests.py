"""Requests the CPU and GPU recurrent-depth tests share (ids < 1024, the tiny vocab of
``latentserve.bench.baseline.recurrent_models``)."""

from __future__ import annotations

# Six prompts of 3 to 33 tokens, four of them sharing a prefix (three its 24 tokens, one its
# first 13), and one Huginn exit rule per prompt,
# ``(depth, criterion, threshold, min_steps, check_every)``.
_PREFIX = [(7 * i + 11) % 900 + 20 for i in range(24)]
RECURRENT_PROMPTS = [_PREFIX + [100, 101], _PREFIX + [200] * 5, _PREFIX[:13], [5, 6, 7],
                     [(11 * i + 3) % 800 + 30 for i in range(19)],
                     _PREFIX + [300 + i for i in range(9)]]
HUGINN_EXITS = [
    (8, "latent-diff", 0.2, 0, 1), (6, "kl", 0.01, 1, 1), (8, "entropy-diff", 0.05, 0, 2),
    (8, "argmax-stability", 2, 0, 1), (5, "cosine", 0.01, 0, 1), (8, "minp-kl", 1e-3, 2, 1),
]


def mixed_recurrent_requests(family: str) -> list:
    """``[(prompt ids, SamplingParams)]`` over ``RECURRENT_PROMPTS`` for a ``family``
    (``"huginn"`` or ``"ouro"``) model: greedy and seeded sampling, default and own depths,
    an exit rule on half of them, a trace on half of them (ignore_eos, 6 to 9 tokens)."""
    from latentserve.sampling_params import SamplingParams

    exit_fields = ({"exit_criterion": "kl", "exit_threshold": 0.01} if family == "huginn"
                   else {"exit_criterion": "threshold", "exit_threshold": 0.5})
    kinds = [
        SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True, latent_budget=4),
        SamplingParams(max_tokens=7, temperature=0.9, seed=3, ignore_eos=True,
                       return_latent_trace=True),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, latent_budget=2,
                       return_latent_trace=True, **exit_fields),
        SamplingParams(max_tokens=6, temperature=0.7, top_k=20, seed=11, ignore_eos=True,
                       **exit_fields),
    ]
    return [(p, kinds[i % len(kinds)]) for i, p in enumerate(RECURRENT_PROMPTS)]
