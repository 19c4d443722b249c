"""The Llama family (Llama 2/3.x, SmolLM2, Qwen2, Mistral without sliding window), names as
transformers ``models/llama/modeling_llama.py`` and ``models/qwen2/modeling_qwen2.py``."""

from __future__ import annotations

import torch
from torch import nn

from latentserve.context import get_context
from latentserve.models.layers import (
    MergedQKV,
    RMSNorm,
    Rotary,
    decode_gemms,
    fuse_decoder,
    inject,
    materialize,
    merge_linears,
    paged_attention,
)
from latentserve.models.weights import load_by_name
from latentserve.ops.rotary import apply_rotary
from latentserve.sampling import greedy_tokens


class LlamaAttention(MergedQKV, nn.Module):
    def __init__(self, cfg, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        qkv_bias = cfg.model_type == "qwen2" or getattr(cfg, "attention_bias", False)
        o_bias = cfg.model_type != "qwen2" and getattr(cfg, "attention_bias", False)
        h, d = cfg.hidden_size, self.head_dim
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=o_bias)
        self.scale = d**-0.5

    def forward(self, x, cos, sin, partials: bool = False):
        """``[T, hidden]`` -> ``[T, hidden]``, or with ``partials`` o_proj's fp32 split-K
        partials ``[S, T, hidden]``."""
        t, d = x.shape[0], self.head_dim
        if self.fused:  # MergedQKV.fuse() ran: one q/k/v GEMM, one RoPE (+ KV store) kernel
            return self.fused_attention_out(x, cos, sin, self.layer, partials)
        q = self.q_proj(x).view(t, self.n_heads, d)
        k = self.k_proj(x).view(t, self.n_kv, d)
        v = self.v_proj(x).view(t, self.n_kv, d)
        q, k = apply_rotary(q, k, cos, sin)
        o = paged_attention(self.layer, q, k, v, self.scale)
        return self.o_proj(o.reshape(t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        bias = getattr(cfg, "mlp_bias", False)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=bias)
        self.fused = False

    def fuse(self) -> None:
        """Fast path: one gate/up GEMM (``gate_up_proj``, gate rows first) and the
        SiLU-and-multiply Triton kernel. Call after loading weights."""
        self.gate_up_proj = merge_linears(self.gate_proj, self.up_proj)
        del self.gate_proj, self.up_proj
        self.fused = True

    def forward(self, x, partials: bool = False):
        """x ``[T, hidden]`` -> ``[T, hidden]``, or (``partials`` on the decode path, no
        down bias) the down projection's fp32 split-K partial sums ``[S, T, hidden]``."""
        if self.fused:
            from latentserve.ops import kernels

            if decode_gemms(True, x, self.gate_up_proj, self.down_proj):
                act = kernels.decode_linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias,
                                            swiglu=True)
                if partials and self.down_proj.bias is None:
                    return kernels.decode_linear(act, self.down_proj.weight, partials=True)
                return kernels.decode_linear(act, self.down_proj.weight, self.down_proj.bias)
            return self.down_proj(kernels.silu_and_mul(self.gate_up_proj(x)))
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg, layer: int):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, cos, sin):
        """``(x, residual)`` -> ``(mlp_out, residual)``, summed by the next norm (``mlp_out``
        may be fp32 split-K partials ``[S, T, hidden]``)."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos, sin, partials=True)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x, partials=True), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.rotary_emb = Rotary(cfg, head_dim)


class LlamaForCausalLM(nn.Module):
    """Paged-KV Llama: ``forward(input_ids [T], positions [T], input_embeds, latent_mask)``
    -> final normed ``[T, hidden]``; ``compute_logits`` -> ``[B, vocab]`` float32."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg)
        self.tie = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if self.tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        """(num KV layers, num KV heads, head_dim)."""
        att = self.model.layers[0].self_attn
        return len(self.model.layers), att.n_kv, att.head_dim

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def use_fused_ops(self) -> None:
        """Switch to the CUDA fast path (``latentserve.ops.kernels``); call once after
        ``load_weights`` (not usable afterwards); CPU only under ``TRITON_INTERPRET=1``."""
        fuse_decoder(self, self.model.layers)

    def prepare_positions(self, max_positions: int) -> None:
        """Fast path: precompute the RoPE table (``Rotary.build_table``) on the final device."""
        if self.model.norm.fused:
            self.model.rotary_emb.build_table(max_positions, self.model.embed_tokens.weight.dtype)

    def forward(self, input_ids, positions, input_embeds=None, latent_mask=None):
        emb = self.model.embed_tokens
        if self.model.norm.fused and type(emb) is nn.Embedding:  # not a tensor-parallel shard
            from latentserve.ops.kernels.embed_inject import embed_inject

            x = embed_inject(emb.weight, input_ids, input_embeds, latent_mask)
        else:
            x = inject(self.embed(input_ids), input_embeds, latent_mask)
        cos, sin = self.model.rotary_emb.cos_sin(positions, x.dtype)  # once, for every layer
        ctx, residual = get_context(), None
        for i, layer in enumerate(self.model.layers):
            x, residual = layer(x, residual, cos, sin)
            if ctx.capture_layer == i + 1:
                ctx.maybe_capture(i + 1, materialize(x, residual) + residual)
        return self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head_fast(hidden):
            from latentserve.ops.kernels import decode_linear

            # fp32 logits holding the bf16-rounded values, with no separate cast kernel
            return decode_linear(hidden, self.lm_head.weight, self.lm_head.bias,
                                 out_dtype=torch.float32)
        return self.lm_head(hidden).float()

    def lm_head_fast(self, hidden: torch.Tensor) -> bool:
        """Whether the LM head runs as one local ``decode_linear`` (never under TP)."""
        return decode_gemms(self.model.norm.fused, hidden, self.lm_head)

    def compute_logits_greedy(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(compute_logits(hidden), row-wise argmax [B] int64)``, one kernel when possible."""
        if self.lm_head_fast(hidden) and "compute_logits" not in vars(self):
            from latentserve.ops.kernels.decode_linear import decode_linear_argmax, pick_tiling

            if pick_tiling(hidden.shape[0], *self.lm_head.weight.shape)[2] <= 1:
                return decode_linear_argmax(hidden, self.lm_head.weight, self.lm_head.bias,
                                            out_dtype=torch.float32)
        logits = self.compute_logits(hidden)
        return logits, greedy_tokens(logits)

    def load_weights(self, weights) -> None:
        """Load HF-named ``(name, tensor)`` pairs; KeyError on an unexpected name, ValueError
        on a missing one."""
        load_by_name(self, weights,
                     rename=lambda n: None if "rotary_emb.inv_freq" in n else n,
                     tied=("lm_head.weight", "model.embed_tokens.weight") if self.tie else ())
