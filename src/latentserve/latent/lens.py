"""A latent step's trace entry (``return_latent_trace``): the logit lens of its input vector
through the LM head (nostalgebraist, "interpreting GPT: the logit lens", 2020)."""

from __future__ import annotations

import torch

LENS_TOP = 5  # tokens per latent step


def lens_entries(model, vecs: torch.Tensor) -> list[dict]:
    """The trace entries of latent inputs ``vecs`` ``[n >= 1, hidden]`` (any float dtype), one
    per row: their L2 norm, the ``LENS_TOP`` largest LM-head logits (``model.compute_logits``)
    and those tokens' probabilities."""
    with torch.inference_mode():
        logits = model.compute_logits(vecs).float()
        top = logits.topk(LENS_TOP, dim=-1)
        probs = (top.values - logits.logsumexp(-1, keepdim=True)).exp()
        norms = vecs.float().norm(dim=-1)
    return [{"norm": float(n), "top_tokens": [[int(t), float(v)] for t, v in zip(ids, vals)],
             "top_probs": [float(p) for p in ps]}
            for n, ids, vals, ps in zip(norms.tolist(), top.indices.tolist(),
                                        top.values.tolist(), probs.tolist())]
