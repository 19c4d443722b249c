"""GPT-2: learned positions, pre-LayerNorm blocks, fused ``c_attn``, GELU (tanh); ``Conv1D`` weights
``[in, out]`` are transposed at load; names as HF's ``GPT2LMHeadModel`` (``transformer.`` optional);
LM head tied to ``wte``. Source: transformers ``models/gpt2/modeling_gpt2.py``."""

from __future__ import annotations

import torch
from torch import nn

from latentserve.context import get_context
from latentserve.models.layers import inject, paged_attention
from latentserve.models.weights import load_by_name

_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


class GPT2Attention(nn.Module):
    def __init__(self, cfg, layer: int):
        super().__init__()
        if any(getattr(cfg, k, False) for k in ("scale_attn_by_inverse_layer_idx",
                                                 "reorder_and_upcast_attn")):
            raise ValueError("GPT-2 variants with scale_attn_by_inverse_layer_idx or "
                             "reorder_and_upcast_attn are not supported")
        self.layer = layer
        self.n_heads = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.scale = self.head_dim**-0.5 if getattr(cfg, "scale_attn_weights", True) else 1.0

    def forward(self, x):
        t = x.shape[0]
        q, k, v = self.c_attn(x).view(t, 3, self.n_heads, self.head_dim).unbind(1)
        return self.c_proj(paged_attention(self.layer, q, k, v, self.scale).reshape(t, -1))


class GPT2MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        inner = cfg.n_inner or 4 * cfg.n_embd
        self.c_fc = nn.Linear(cfg.n_embd, inner)
        self.c_proj = nn.Linear(inner, cfg.n_embd)

    def forward(self, x):
        return self.c_proj(nn.functional.gelu(self.c_fc(x), approximate="tanh"))


class GPT2Block(nn.Module):
    def __init__(self, cfg, layer: int):
        super().__init__()
        eps = cfg.layer_norm_epsilon
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=eps)
        self.attn = GPT2Attention(cfg, layer)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=eps)
        self.mlp = GPT2MLP(cfg)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.h = nn.ModuleList(GPT2Block(cfg, i) for i in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_epsilon)


class GPT2LMHeadModel(nn.Module):
    """Paged-KV GPT-2 with ``LlamaForCausalLM``'s interface (``forward`` -> ``[T, n_embd]``
    after ``ln_f``); masked ``input_embeds`` rows replace the token embedding only, position
    embeddings are always added (as HF)."""

    def __init__(self, cfg):
        super().__init__()
        if getattr(cfg, "activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"GPT-2 activation_function {cfg.activation_function!r} is not "
                             "supported (gelu_new only)")
        self.config = cfg
        self.transformer = GPT2Model(cfg)

    @property
    def kv_shape(self) -> tuple[int, int, int]:
        att = self.transformer.h[0].attn
        return len(self.transformer.h), att.n_heads, att.head_dim

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.transformer.wte(input_ids)

    def forward(self, input_ids, positions, input_embeds=None, latent_mask=None):
        x = inject(self.embed(input_ids), input_embeds, latent_mask)
        x = x + self.transformer.wpe(positions)
        ctx = get_context()
        for i, block in enumerate(self.transformer.h):
            x = block(x)
            ctx.maybe_capture(i + 1, x)
        return self.transformer.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return (hidden @ self.transformer.wte.weight.t()).float()

    def load_weights(self, weights) -> None:
        """Load ``(name, tensor)`` pairs, with or without the ``transformer.`` prefix.
        Raises KeyError on an unexpected name, ValueError when a weight is missing."""

        def hf_layout(weights):
            for name, tensor in weights:
                if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
                    continue  # tied head; causal-mask buffers of old checkpoints
                name = name if name.startswith("transformer.") else "transformer." + name
                yield name, tensor.t() if name.endswith(_CONV1D) else tensor

        load_by_name(self, hf_layout(weights))
