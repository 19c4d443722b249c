"""RMSNorm with an optional residual add, in torch (Hugging Face ``LlamaRMSNorm`` numerics).

Source: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"; rounding as in
transformers ``models/llama/modeling_llama.py`` (normalize in fp32, cast to the input dtype,
then multiply by the weight in that dtype).
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x * rsqrt(mean(x^2) + eps))`` over the last dim.

    x: ``[..., hidden]`` any float dtype; weight: ``[hidden]``. The mean and rsqrt are taken
    in fp32; the normalized value is cast back to ``x.dtype`` before the weight multiply.
    Returns ``[..., hidden]`` in the promoted dtype of ``weight`` and ``x`` (``x.dtype``
    when they agree, as they do in the engine).
    """
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm block boundary: ``residual = x + residual`` (in their dtype), then
    ``rms_norm(residual)``.

    x, residual: ``[..., hidden]`` same dtype; weight: ``[hidden]``.
    Returns ``(normed, residual)``, both ``[..., hidden]``.
    """
    residual = x + residual
    return rms_norm(residual, weight, eps), residual
