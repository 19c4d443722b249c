"""RMSNorm with an optional residual add, in torch. Source: Zhang & Sennrich 2019; rounding as
transformers ``models/llama/modeling_llama.py`` (fp32 normalize, cast, then weight multiply)."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last dim: x ``[..., hidden]``,
    weight ``[hidden]``; statistics in fp32, cast to ``x.dtype`` before the weight multiply.
    Returns ``[..., hidden]`` in the promoted dtype of ``weight`` and ``x``."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm block boundary: ``residual = x + residual`` (same dtype), then
    ``(rms_norm(residual), residual)``, both ``[..., hidden]``."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def norm_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, pre_weight: torch.Tensor,
                      weight: torch.Tensor, eps: float,
                      pre_eps: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The sandwich-norm block boundary (Ouro): ``s = residual + rms_norm(x, pre_weight)``
    (the add in the promoted dtype), then ``(rms_norm(s, weight), s)``, both
    ``[..., hidden]``; ``pre_eps`` defaults to ``eps``."""
    s = residual + rms_norm(x, pre_weight, eps if pre_eps is None else pre_eps)
    return rms_norm(s, weight, eps), s
