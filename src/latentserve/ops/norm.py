"""RMSNorm with an optional residual add, in torch. Source: Zhang & Sennrich 2019; rounding as
transformers ``models/llama/modeling_llama.py`` (fp32 normalize, cast, then weight multiply)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last dim: x ``[..., hidden]``,
    weight ``[hidden]``; statistics in fp32, cast to ``x.dtype`` before the weight multiply.
    Returns ``[..., hidden]`` in the promoted dtype of ``weight`` and ``x``."""
    h = x.float()
    return weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm block boundary: ``residual = x + residual`` (same dtype), then
    ``(rms_norm(residual), residual)``, both ``[..., hidden]``."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual

