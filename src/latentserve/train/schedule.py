"""AdamW with a linear warmup then linear decay to zero, shared by SFT and GRPO."""

from __future__ import annotations

import torch


def adamw_warmup_linear(params, lr: float, steps: int, warmup: float = 0.05,
                        weight_decay: float = 0.01):
    """``(optimizer, scheduler)``: ``torch.optim.AdamW`` over ``params`` and a ``LambdaLR``
    whose factor rises linearly over ``round(warmup * steps)`` steps (at least 1) from
    1/(warmup steps) to 1, then falls linearly to 0 at ``steps`` (the ranges: the options'
    ``lr``, ``steps`` and ``warmup``)."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    n_warm = max(1, round(warmup * steps))

    def factor(step: int) -> float:
        if step < n_warm:
            return (step + 1) / n_warm
        return max(0.0, (steps - step) / max(1, steps - n_warm))

    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factor)
