"""Building blocks shared by the model files: RMSNorm, rotary embedding and the paged
attention call. Numerics follow Hugging Face transformers' Llama modules so fp32 logits
match within 1e-4."""

from __future__ import annotations

import torch
from torch import nn

from latentserve.context import get_context


class RMSNorm(nn.Module):
    """``x * rsqrt(mean(x^2) + eps) * weight``, computed in fp32 (as ``LlamaRMSNorm``)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Rotary(nn.Module):
    """Rotary position embedding with the rotate-half convention.

    ``inv_freq`` and the attention scaling come from transformers' ``ROPE_INIT_FUNCTIONS``
    for scaled variants (llama3, yarn, linear, ...) and the plain formula otherwise.
    ``forward(positions [T] int64, q [T, H, D], k [T, Hkv, D])`` returns rotated q, k.
    """

    def __init__(self, hf_config, head_dim: int):
        super().__init__()
        params = getattr(hf_config, "rope_parameters", None) or {}
        rope_type = params.get("rope_type", "default")
        if rope_type == "default":
            base = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
            inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None)
        self.register_buffer("inv_freq", inv.float(), persistent=False)
        self.scaling = float(scaling)

    def forward(self, positions, q, k):
        freqs = positions[:, None].float() * self.inv_freq.to(q.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = (emb.cos() * self.scaling).to(q.dtype)[:, None, :]
        sin = (emb.sin() * self.scaling).to(q.dtype)[:, None, :]
        return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def inject(embeds: torch.Tensor, input_embeds: torch.Tensor | None,
           latent_mask: torch.Tensor | None) -> torch.Tensor:
    """Swap latent rows in right after the embedding lookup.

    embeds: ``[T, H]`` token embeddings; input_embeds: ``[T, H]`` (any float dtype) or None;
    latent_mask: ``[T] bool`` or None. Returns ``[T, H]`` in ``embeds``' dtype.
    """
    if input_embeds is None:
        return embeds
    return torch.where(latent_mask[:, None], input_embeds.to(embeds.dtype), embeds)


def paged_attention(layer: int, q, k, v, scale: float) -> torch.Tensor:
    """Store this layer's new K/V and attend over each request's pages.

    q: ``[T, H, D]``; k, v: ``[T, Hkv, D]``. Returns ``[T, H, D]``. Reads the forward context.
    """
    ctx = get_context()
    return ctx.backend.forward(layer, q, k, v, ctx.attn_meta, ctx.kv_pool, scale)
