"""Rotary position embedding (rotate-half) in torch. Source: RoFormer (arXiv 2104.09864);
layout and rounding (cos/sin cast to the activation dtype) as transformers
``models/llama/modeling_llama.py``."""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)`` of ``positions [T] int64 * inv_freq [head_dim / 2]`` (fp32 angles),
    times ``scaling`` (1.0 for plain RoPE), duplicated over both halves: ``[T, head_dim]`` in
    ``dtype``."""
    freqs = positions[:, None].float() * inv_freq.to(positions.device)[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[-x2, x1]`` for ``x = [x1, x2]`` split in halves along the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q ``[T, H, D]`` and k ``[T, Hkv, D]`` by cos, sin ``[T, D]`` (from
    ``rope_cos_sin``, same dtype as q). Returns new ``(q, k)`` tensors."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
