"""Blocks shared by the model files: RMSNorm, rotary embedding, projection merging, paged
attention. Numerics follow transformers' Llama modules (fp32 logits within 1e-4)."""

from __future__ import annotations

import torch
from torch import nn

from latentserve import settings
from latentserve.context import get_context
from latentserve.ops.norm import add_rms_norm, rms_norm
from latentserve.ops.rotary import rope_cos_sin


class RMSNorm(nn.Module):
    """RMSNorm as ``LlamaRMSNorm`` (fp32 statistics): ``forward(x [T, H])`` -> normed;
    ``forward(x, residual)`` -> ``(normed(x + residual), x + residual)``; ``fused``: Triton."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = False

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused:
            from latentserve.ops.kernels import rms_norm as fused_rms_norm

            return fused_rms_norm(x, self.weight, self.eps, residual)
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return add_rms_norm(x, residual, self.weight, self.eps)


def sandwich_add_norm(x: torch.Tensor, residual: torch.Tensor, pre: RMSNorm,
                      post: RMSNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """A sandwich-norm block boundary (Ouro): ``s = residual + pre(x)``, then ``(post(s),
    s)``, both ``[T, hidden]``. With ``post.fused``: one kernel (``ops.kernels.rms_norm``
    with ``pre_weight``), and x may be fp32 split-K partials ``[S, T, hidden]``."""
    if post.fused:
        from latentserve.ops.kernels import rms_norm as fused_rms_norm

        return fused_rms_norm(x, post.weight, post.eps, residual, pre.weight, pre.eps)
    s = residual + pre(x)
    return post(s), s


DECODE_ROWS = settings.get("LATENTSERVE_DECODE_ROWS")
"""Up to this many rows the fast path runs its weight GEMMs as ``ops.kernels.decode_linear``
(a decode step's batch); larger batches and ``0`` keep cuBLAS."""
QKV_ROPE_ROWS = (17, 64)
"""Row counts (inclusive) for which the fast path runs q/k/v, RoPE and the KV store as one
kernel (``ops.kernels.qkv_rope_store_kv``), with TMA only (docs/internals.md)."""


def decode_gemms(fused: bool, x: torch.Tensor, *linears: nn.Module) -> bool:
    """Whether ``linears`` run on ``x [..., T, K]`` as ``decode_linear``: ``fused``, local
    weights of x's dtype, ``0 < T <= DECODE_ROWS``."""
    return (fused and 0 < x.shape[-2] <= DECODE_ROWS
            and all(type(lin) is nn.Linear and lin.weight.dtype == x.dtype
                    for lin in linears))


def materialize(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[T, H]`` in ``like``'s dtype: the sum of split-K partials ``[S, T, H]`` in
    the RMSNorm kernel's order (bit for bit), or ``x`` itself."""
    if x.dim() != 3:
        return x
    total = x[0].clone()
    for part in x[1:]:
        total += part
    return total.to(like.dtype)


class Rotary(nn.Module):
    """Rotary position embedding (rotate-half); scaled variants from transformers'
    ``ROPE_INIT_FUNCTIONS``. ``cos_sin(positions [T] int64, dtype)`` -> ``(cos, sin)`` each
    ``[T, head_dim]``."""

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

    _table: torch.Tensor | None = None

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        table = self._table
        if table is not None and table.dtype == dtype and table.device == positions.device:
            # NOTE: clamped, so a position past the table can never fault the device
            if table.is_cuda:  # one PDL kernel instead of torch's clamp and index
                from latentserve.ops.kernels.rope_rows import rope_rows

                rows = rope_rows(table, positions)
            else:
                rows = table[positions.clamp(0, table.shape[0] - 1)]
            return rows[:, 0], rows[:, 1]
        return rope_cos_sin(positions, self.inv_freq, self.scaling, dtype)

    def build_table(self, max_positions: int, dtype: torch.dtype) -> None:
        """Precompute ``[max_positions, 2, head_dim]`` cos/sin in ``dtype`` (later positions
        clamp to the last row); outside CUDA-graph capture."""
        if max_positions < 1:
            raise ValueError(f"max_positions must be >= 1, got {max_positions}")
        pos = torch.arange(max_positions, device=self.inv_freq.device)
        cos, sin = rope_cos_sin(pos, self.inv_freq, self.scaling, dtype)
        self._table = torch.stack((cos, sin), dim=1)


class MergedQKV:
    """Fast path of an attention with ``q/k/v_proj``: ``fuse()`` merges them into
    ``qkv_proj``; ``fused_attention`` runs it, RoPE and attention."""

    fused = False

    def fuse(self) -> None:
        self.qkv_proj = merge_linears(self.q_proj, self.k_proj, self.v_proj)
        del self.q_proj, self.k_proj, self.v_proj
        self.fused = True

    def fused_attention(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        layer: int, next_weight: torch.Tensor | None = None) -> torch.Tensor:
        """x ``[T, hidden]``, cos/sin ``[T, head_dim]``, ``layer`` the KV pool layer ->
        ``[T, H, D]``, as ``paged_attention``; ``next_weight``: the prefetch hint."""
        from latentserve.ops.kernels import (
            apply_rotary_,
            apply_rotary_store_kv_,
            qkv_rope_store_kv,
        )
        from latentserve.ops.kernels.decode_linear import use_tma

        ctx = get_context()
        t, d = x.shape[0], self.head_dim
        if (ctx.backend.fused_kv_store and decode_gemms(True, x, self.qkv_proj)
                and QKV_ROPE_ROWS[0] <= t <= QKV_ROPE_ROWS[1]
                and use_tma(x, self.qkv_proj.weight)):
            q = qkv_rope_store_kv(x, self.qkv_proj.weight, self.qkv_proj.bias, cos, sin,
                                  ctx.kv_pool.k[layer], ctx.kv_pool.v[layer],
                                  ctx.attn_meta.out_slots, self.n_heads, self.n_kv)
            return ctx.backend.forward(layer, q, None, None, ctx.attn_meta, ctx.kv_pool,
                                       self.scale, prefetch_next=next_weight)
        qkv = self.qkv_proj(x)
        nq, nk = self.n_heads * d, self.n_kv * d
        q = qkv[:, :nq].view(t, self.n_heads, d)
        k = qkv[:, nq : nq + nk].view(t, self.n_kv, d)
        v = qkv[:, nq + nk :].view(t, self.n_kv, d)
        if ctx.backend.fused_kv_store:
            apply_rotary_store_kv_(q, k, v, cos, sin, ctx.kv_pool.k[layer],
                                   ctx.kv_pool.v[layer], ctx.attn_meta.out_slots)
            k = v = None  # in the pool now (k there rotated, here not)
        else:
            apply_rotary_(q, k, cos, sin)
        return ctx.backend.forward(layer, q, k, v, ctx.attn_meta, ctx.kv_pool, self.scale,
                                   prefetch_next=next_weight)

    def fused_attention_out(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                            layer: int, partials: bool = False) -> torch.Tensor:
        """``o_proj(fused_attention(...))``: ``[T, hidden]``, or with ``partials`` (and no
        o_proj bias) its fp32 split-K partials ``[S, T, hidden]`` for the next RMSNorm
        kernel. On the decode-GEMM path o_proj runs as ``decode_linear``, and decode
        attention prefetches its weight into L2 as it ends (so it splits K less)."""
        t = x.shape[0]
        gemm = decode_gemms(True, x, self.o_proj)
        w = self.o_proj.weight if gemm else None
        o = self.fused_attention(x, cos, sin, layer, w).reshape(t, -1)
        if not gemm:
            return self.o_proj(o)
        from latentserve.ops import kernels

        ctx = get_context()
        in_l2 = ctx.backend.prefetches(ctx.attn_meta, w, self.n_kv)
        if partials and self.o_proj.bias is None:
            return kernels.decode_linear(o, w, partials=True, weight_in_l2=in_l2)
        return kernels.decode_linear(o, w, self.o_proj.bias, weight_in_l2=in_l2)


def fuse_decoder(model: nn.Module, layers) -> None:
    """Put ``model`` on the fast path: every layer's ``self_attn.fuse()`` and ``mlp.fuse()``
    (merged GEMMs, RoPE and SiLU-mul kernels) and the RMSNorm kernel for every RMSNorm."""
    for layer in layers:
        layer.self_attn.fuse()
        layer.mlp.fuse()
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.fused = True


def merge_linears(*linears: nn.Module) -> nn.Linear:
    """One ``nn.Linear`` whose output is the layers' outputs concatenated (same input size,
    all or none with a bias)."""
    w = torch.cat([lin.weight.detach() for lin in linears], dim=0)
    has_bias = [lin.bias is not None for lin in linears]
    if len(set(has_bias)) != 1 or len({lin.weight.shape[1] for lin in linears}) != 1:
        raise ValueError("merge_linears needs equal input sizes and all or no biases")
    merged = nn.Linear(w.shape[1], w.shape[0], bias=has_bias[0], device=w.device,
                       dtype=w.dtype)
    with torch.no_grad():
        merged.weight.copy_(w)
        if has_bias[0]:
            merged.bias.copy_(torch.cat([lin.bias.detach() for lin in linears]))
    return merged.requires_grad_(linears[0].weight.requires_grad)


def inject(embeds: torch.Tensor, input_embeds: torch.Tensor | None,
           latent_mask: torch.Tensor | None) -> torch.Tensor:
    """``embeds [T, H]`` with ``input_embeds [T, H]`` rows where ``latent_mask [T]``, in
    ``embeds``' dtype."""
    if input_embeds is None:
        return embeds
    return torch.where(latent_mask[:, None], input_embeds.to(embeds.dtype), embeds)


def paged_attention(layer: int, q, k, v, scale: float) -> torch.Tensor:
    """Store this layer's new K/V and attend over each request's pages (reads the forward
    context). q ``[T, H, D]``; k, v ``[T, Hkv, D]``, or None when already in the pool (the
    backend's ``fused_kv_store``). Returns ``[T, H, D]``."""
    ctx = get_context()
    return ctx.backend.forward(layer, q, k, v, ctx.attn_meta, ctx.kv_pool, scale)
