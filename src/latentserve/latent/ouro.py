"""Ouro (arXiv 2510.25741): the decoder stack looped ``total_ut_steps`` times per token with
an exit gate; names as the hub's ``modeling_ouro.py`` (docs/internals.md)."""

from __future__ import annotations

import math

import torch
from torch import nn

from latentserve.context import get_context
from latentserve.latent.recurrent import ExitRule, RecurrentLM, recur_compact
from latentserve.latent.spec import LatentSpec
from latentserve.models.layers import (
    MergedQKV,
    RMSNorm,
    Rotary,
    fuse_decoder,
    inject,
    paged_attention,
    sandwich_add_norm,
)
from latentserve.models.llama import LlamaMLP
from latentserve.models.weights import load_by_name
from latentserve.ops.rotary import rotate_half


def ouro_config(d: dict):
    """A ``PretrainedConfig`` from Ouro's ``config.json`` dict (transformers has no Ouro class;
    the hub's is remote code)."""
    from transformers import PretrainedConfig

    cfg = PretrainedConfig(**d)
    cfg.model_type = "ouro"
    rs = d.get("rope_scaling")
    if rs and getattr(cfg, "rope_parameters", None) is None:
        cfg.rope_parameters = {**rs, "rope_theta": d.get("rope_theta", 10000.0)}
    return cfg


class OuroAttention(MergedQKV, nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_heads
        self.head_dim = d = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_heads
        h = cfg.hidden_size
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=False)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.scale = d**-0.5

    def forward(self, x, cos, sin, bank: int, partials: bool = False):
        """x ``[T, hidden]``; cos, sin ``[T, 1, head_dim]`` (``OuroForCausalLM.rope``) ->
        ``[T, hidden]``, or on the fast path with ``partials`` o_proj's fp32 split-K
        partials ``[S, T, hidden]``."""
        t, d = x.shape[0], self.head_dim
        if self.fused:  # MergedQKV.fuse() ran: one q/k/v GEMM, one RoPE (+ KV store) kernel
            return self.fused_attention_out(x, cos[:, 0], sin[:, 0], bank, partials)
        q = self.q_proj(x).view(t, self.n_heads, d)
        k = self.k_proj(x).view(t, self.n_kv, d)
        v = self.v_proj(x).view(t, self.n_kv, d)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        o = paged_attention(bank, q, k, v, self.scale)
        return self.o_proj(o.reshape(t, -1))


class OuroDecoderLayer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        eps = cfg.rms_norm_eps
        self.self_attn = OuroAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.input_layernorm_2 = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps)
        self.post_attention_layernorm_2 = RMSNorm(cfg.hidden_size, eps)

    def forward(self, x, cos, sin, bank: int):
        """The upstream formula (the reference): x ``[T, hidden]`` -> ``[T, hidden]``."""
        x = x + self.input_layernorm_2(self.self_attn(self.input_layernorm(x), cos, sin, bank))
        return x + self.post_attention_layernorm_2(self.mlp(self.post_attention_layernorm(x)))

    def fused_forward(self, normed, x, cos, sin, bank: int, next_norm: RMSNorm):
        """``forward`` on the fast path: ``normed`` = ``input_layernorm(x)`` -> ``(
        next_norm(out), out)``, ``out`` = ``forward(x)``, all ``[T, hidden]``. Each ``*_2``
        norm, its residual add and the norm after it run as one kernel
        (``sandwich_add_norm``), which also sums o_proj's and the down projection's split-K
        partials."""
        a = self.self_attn(normed, cos, sin, bank, partials=True)
        normed, x = sandwich_add_norm(a, x, self.input_layernorm_2,
                                      self.post_attention_layernorm)
        m = self.mlp(normed, partials=True)
        return sandwich_add_norm(m, x, self.post_attention_layernorm_2, next_norm)


class OuroModel(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(OuroDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.early_exit_gate = nn.Linear(cfg.hidden_size, 1)
        self.rotary_emb = Rotary(cfg, self.layers[0].self_attn.head_dim)


class OuroForCausalLM(RecurrentLM):
    """Paged-KV Ouro, depth and readout from ``ForwardContext.recurrent``: ``forward`` ->
    normed readout ``[T, hidden]``; ``compute_logits`` -> ``[B, vocab]`` float32."""

    def __init__(self, cfg):
        super().__init__()
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"Ouro hidden_act {cfg.hidden_act!r} is not supported (silu only)")
        if "sliding_attention" in (getattr(cfg, "layer_types", None) or ()):
            raise ValueError("Ouro sliding-window layers are not supported")
        self.config = cfg
        self.model = OuroModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie = bool(getattr(cfg, "tie_word_embeddings", False))
        if self.tie:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.total_steps = int(getattr(cfg, "total_ut_steps", None) or 4)
        self.init_depth(cfg, self.total_steps, "total_ut_steps",
                        self.model.rotary_emb.inv_freq, cfg.num_hidden_layers)
        step = getattr(cfg, "early_exit_step", None)
        thr = getattr(cfg, "early_exit_threshold", None)
        default = self.total_steps
        default_exit = None
        if step is not None and 0 <= step < self.total_steps:
            default = step + 1  # exit_at_step k == depth k + 1, last-step readout
        elif thr is not None:
            default_exit = ExitRule("threshold", float(thr))
        self.latent_spec = LatentSpec(kind="recurrent", family="ouro", default_budget=default,
                                      max_budget=self.max_depth, min_budget=1,
                                      default_exit=default_exit)

    def use_fused_ops(self) -> None:
        """The CUDA fast path, as ``LlamaForCausalLM.use_fused_ops``."""
        fuse_decoder(self, self.model.layers)

    def embed(self, input_ids):
        return self.model.embed_tokens(input_ids)

    def rope(self, positions, dtype):
        """``(cos, sin)``, each ``[T, 1, head_dim]`` in ``dtype`` (rotate-half convention)."""
        rot = self.model.rotary_emb
        freqs = self.freqs(positions)
        emb = torch.cat((freqs, freqs), dim=-1)
        return ((emb.cos() * rot.scaling).to(dtype)[:, None, :],
                (emb.sin() * rot.scaling).to(dtype)[:, None, :])

    def step(self, h, cos, sin, t: int):
        """One loop: every layer with step ``t``'s banks, then the final norm. Fast path:
        ``OuroDecoderLayer.fused_forward``, each layer's last kernel also computing the next
        layer's ``input_layernorm`` (the last layer's: the final norm); within two ulps of
        the separate norm kernels and adds (docs/internals.md)."""
        layers = self.model.layers
        if not self.model.norm.fused:
            for l, layer in enumerate(layers):
                h = layer(h, cos, sin, self.bank(t, l))
            return self.model.norm(h)
        normed = layers[0].input_layernorm(h)
        nexts = [*(layer.input_layernorm for layer in layers[1:]), self.model.norm]
        for l, (layer, nxt) in enumerate(zip(layers, nexts)):
            normed, h = layer.fused_forward(normed, h, cos, sin, self.bank(t, l), nxt)
        return normed

    def forward(self, input_ids, positions, input_embeds=None, latent_mask=None):
        ctx = get_context()
        h = inject(self.embed(input_ids), input_embeds, latent_mask)
        cos, sin = self.rope(positions, h.dtype)
        rb = getattr(ctx, "recurrent", None)
        n = h.shape[0]
        dev = h.device
        depths = getattr(ctx, "depths", None)
        if depths is None:
            depths = torch.full((n,), self.total_steps if rb is None else rb.num_iters,
                                dtype=torch.int64, device=dev)
        ro = _Readout(self, rb, depths, h)
        if rb is not None and rb.compact:
            def exits(act, t, rows, idx, h):
                active = None if idx is None else torch.zeros(
                    n, dtype=torch.bool, device=dev).index_fill_(0, idx, True)
                hit = ro.update(h, t, active)
                approx = [b for b in rows if rb.eligible[b]]
                if not approx or t + 1 >= max(rb.row_depths[b] for b in approx):
                    return []
                flags = hit[ro.row_tok[torch.tensor(approx, device=dev)]].tolist()  # one read
                return [b for b, f in zip(approx, flags) if f and rb.row_depths[b] > t + 1]

            h = recur_compact(self, ctx, rb, h, (cos, sin), self.step, exits)
        else:  # masked: fixed trip count, no host reads (CUDA-graph path)
            steps = self.total_steps if rb is None else rb.num_iters
            for t in range(steps):
                h_new = self.step(h, cos, sin, t)
                live = depths > t
                h = torch.where(live[:, None], h_new, h)
                ro.update(h, t, live)
            self.num_iterations += steps * n
        return ro.result()

    def load_weights(self, weights) -> None:
        """Load ``(name, tensor)`` pairs with the hub's names. Raises KeyError on an unexpected
        name and ValueError when one is missing."""
        load_by_name(self, weights,
                     rename=lambda n: None if "rotary_emb.inv_freq" in n else n,
                     tied=("lm_head.weight", "model.embed_tokens.weight") if self.tie else ())


class _Readout:
    """Running per-token readout over the loop steps: ``rem`` (unassigned mass), ``cum``
    (cumulative exit probability), ``done`` / ``out`` (threshold readout), ``mix``
    (p-weighted hiddens); ``thr [T]`` is +inf for ``last``. Tensor ops only (capturable);
    ``update`` returns ``[T] bool`` "threshold reached now". With ``rb.track_readout``:
    ``rb.readout_steps`` (-1 for ``weighted``) and ``rb.exit_probs`` ``[T, steps]``."""

    def __init__(self, model: OuroForCausalLM, rb, depths, h0):
        n, dev = h0.shape[0], h0.device
        self.model, self.depths = model, depths
        if rb is not None and rb.exit_thr is not None:  # static buffers (graph path)
            thr, self.weighted = rb.exit_thr, rb.exit_weighted
        elif rb is not None and rb.rules is not None:  # eager: from the rows' rules
            thr, self.weighted = rb.token_readout(dev)
        else:  # no recurrent context: last-step readout
            thr = torch.full((n,), math.inf, device=dev)
            self.weighted = torch.zeros(n, dtype=torch.bool, device=dev)
        self.thr = thr.to(h0.dtype)
        self.any_weighted = rb is not None and (rb.exit_thr is not None or any(  # graph: any
            r is not None and r.criterion == "weighted" for r in rb.rules or ()))
        self.row_tok = None
        if rb is not None and rb.compact:  # each row's last token (approximate exits)
            reps = torch.tensor(rb.q_lens)
            self.row_tok = (torch.cumsum(reps, 0) - 1).to(dev)
        self.rem = torch.ones(n, dtype=h0.dtype, device=dev)
        self.cum = torch.zeros(n, dtype=h0.dtype, device=dev)
        self.done = torch.zeros(n, dtype=torch.bool, device=dev)
        self.out = torch.zeros_like(h0)
        self.mix = torch.zeros_like(h0) if self.any_weighted else None
        self.rb = rb
        self.step = self.probs = None
        if rb is not None and rb.track_readout:
            self.step = torch.zeros(n, dtype=torch.int64, device=dev)
            self.probs = [] if rb.exit_probs is None else None

    def update(self, h, t: int, active):
        """Fold step ``t``'s hidden ``h [T, hidden]`` in for ``active`` tokens (``[T] bool``,
        None = all)."""
        lam = torch.sigmoid(self.model.model.early_exit_gate(h).squeeze(-1))
        last = self.depths == t + 1
        p = torch.where(last, self.rem, lam * self.rem)
        rem = torch.where(last, self.rem, self.rem * (1.0 - lam))
        cum = self.cum + p
        hit = ~self.done & ((cum >= self.thr) | last)
        if active is not None:
            p = torch.where(active, p, 0.0)
            rem = torch.where(active, rem, self.rem)
            cum = torch.where(active, cum, self.cum)
            hit = hit & active
        self.rem, self.cum = rem, cum
        self.out = torch.where(hit[:, None], h, self.out)
        self.done = self.done | hit
        if self.step is not None:
            self.step = torch.where(hit, t, self.step)
            if self.probs is not None:
                self.probs.append(p.float())
            else:  # a graph's static buffer
                self.rb.exit_probs[:, t].copy_(p)
        if self.mix is not None:
            self.mix = self.mix + p[:, None] * h
        return hit

    def result(self):
        if self.step is not None:
            steps = torch.where(self.weighted, -1, self.step)
            if self.rb.readout_steps is None:
                self.rb.readout_steps = steps
            else:  # a graph's static buffer
                self.rb.readout_steps.copy_(steps)
            if self.probs:
                self.rb.exit_probs = torch.stack(self.probs, dim=1)
        if self.mix is None:
            return self.out
        return torch.where(self.weighted[:, None], self.mix, self.out)
