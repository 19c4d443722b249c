"""The gated-MLP activation SiLU(gate) * up in torch, on a fused ``[T, 2I]`` projection.

Source: Shazeer 2020, "GLU Variants Improve Transformer" (SwiGLU); rounding as transformers'
``LlamaMLP`` (``silu`` rounded to the activation dtype, then the product).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up: ``[..., 2 * I]`` (gate first, then up). Returns ``silu(gate) * up``,
    ``[..., I]`` in the input dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
