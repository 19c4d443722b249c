"""Teacher-forced training rows for a compression head, captured once on the frozen
backbone (Hugging Face transformers forward with ``output_hidden_states``).

Design notes: docs/internals.md, "latentserve.train.features".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from latentserve.train.cot import right_pad


@dataclass(slots=True)
class Features:
    """Flat rows over all traces (float32, on one device). ``anchor [R, H]``,
    ``stop [R]`` (0/1); ``target``/``embed`` ``[R, H]`` are valid where ``has_target [R]``
    (bool; False on the end-of-reasoning rows)."""

    anchor: torch.Tensor
    target: torch.Tensor
    embed: torch.Tensor
    has_target: torch.Tensor
    stop: torch.Tensor

    def rows(self, idx: torch.Tensor) -> Features:
        """The rows ``idx`` (``[n]`` int64, on the same device), copied."""
        return Features(*(getattr(self, k)[idx] for k in self.__slots__))

    def cat(self, other: Features) -> Features:
        """The rows of ``self``, then those of ``other`` (same device)."""
        return Features(*(torch.cat([getattr(self, k), getattr(other, k)])
                          for k in self.__slots__))


def num_groups(t: int, c: int) -> int:
    """``G = ceil(t / c)``: latent steps standing for ``t`` reasoning tokens."""
    return -(-t // c)


def anchor_positions(p: int, t: int, c: int) -> list[int]:
    """Positions of the ``G + 1`` anchors of a trace (prompt length ``p``, ``t`` reasoning
    tokens, compression factor ``c``; see the module docstring)."""
    g = num_groups(t, c)
    return [p - 1] + [p + k * c - 1 for k in range(1, g)] + [p + t - 1]


@torch.no_grad()
def capture(model, traces, source_layer: int, target_layer: int, c: int,
            batch_size: int = 8, progress: bool = True) -> Features:
    """Run the frozen HF ``model`` over the prompt and reasoning of ``traces`` in right-padded
    batches; returns float32 :class:`Features` on its device. ValueError for a layer index
    out of range."""
    n_layers = model.config.num_hidden_layers
    for name, v in (("source_layer", source_layer), ("target_layer", target_layer)):
        if not 0 <= v < n_layers:
            raise ValueError(f"{name} must be in [0, {n_layers - 1}], got {v}")
    device = next(model.parameters()).device
    rows = {k: [] for k in ("anchor", "target", "embed", "has_target", "stop")}

    for start in tqdm(range(0, len(traces), batch_size), desc="capturing hidden states",
                      unit="batch", disable=not progress):
        batch = traces[start:start + batch_size]
        seqs = [t.prompt + t.reasoning for t in batch]
        ids = right_pad(seqs, 0, device)
        mask = right_pad([[1] * len(s) for s in seqs], 0, device)
        # the base model only: no logits over the vocabulary for every position
        out = model.base_model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        src = out.hidden_states[source_layer + 1].float()
        tgt = out.hidden_states[target_layer + 1].float()
        tgt = F.layer_norm(tgt, (tgt.shape[-1],))
        e = model.get_input_embeddings()(ids).float()
        for i, tr in enumerate(batch):
            p, t = len(tr.prompt), len(tr.reasoning)
            pos = anchor_positions(p, t, c)
            g = len(pos) - 1
            rows["anchor"].append(src[i, pos])
            groups = [(p + k * c, min(p + (k + 1) * c, p + t)) for k in range(g)]
            for key, h in (("target", tgt), ("embed", e)):  # group means, then a zero row
                rows[key].append(torch.cat([torch.stack([h[i, a:b].mean(0) for a, b in groups]),
                                            h.new_zeros(1, h.shape[-1])]))
            last = torch.arange(g + 1, device=device) == g  # the end-of-reasoning row
            rows["has_target"].append(~last)
            rows["stop"].append(last.float())
    return Features(**{k: torch.cat(v) for k, v in rows.items()})
