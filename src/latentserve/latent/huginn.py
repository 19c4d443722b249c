"""Huginn-0125 (arXiv 2502.05171): a prelude, a core block looped ``r`` times per token, a
coda. Names as upstream ``RavenForCausalLM`` (``seal-rg/recurrent-pretraining``,
``recpre/raven_modeling_minimal.py``); docs/internals.md."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from latentserve.context import get_context
from latentserve.latent.recurrent import (
    HUGINN_LOGIT_CRITERIA,
    ActiveRows,
    RecurrentLM,
    recur_compact,
    slot_steps,
)
from latentserve.latent.spec import LatentSpec
from latentserve.models.layers import RMSNorm, inject, paged_attention
from latentserve.models.weights import load_by_name


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs ``(x[2i], x[2i+1])`` in fp32 (upstream's complex-style RoPE).
    x: ``[T, H, D]``; cos, sin: ``[T, 1, D/2]`` float32. Returns x's dtype."""
    xr = x.float().unflatten(-1, (-1, 2))
    a, b = xr[..., 0], xr[..., 1]
    return torch.stack((a * cos - b * sin, b * cos + a * sin), dim=-1).flatten(-2).type_as(x)


class CausalSelfAttention(nn.Module):
    """Fused ``Wqkv`` (q chunk ``n_embd``, k and v ``n_kv * head_dim``), optional ``qk_bias``
    ``[2, 1, heads, head_dim]``, output ``proj``; no linear biases."""

    def __init__(self, n_embd: int, n_head: int, n_kv: int, qk_bias: bool):
        super().__init__()
        self.n_head, self.n_kv = n_head, n_kv
        self.head_dim = d = n_embd // n_head
        self.chunks = [n_embd, n_kv * d, n_kv * d]
        self.Wqkv = nn.Linear(n_embd, (n_head + 2 * n_kv) * d, bias=False)
        self.has_qk_bias = qk_bias
        if qk_bias:
            self.qk_bias = nn.Parameter(torch.zeros(2, 1, n_head, d))
        self.proj = nn.Linear(n_embd, n_embd, bias=False)
        self.scale = d**-0.5
        self.fused = False  # the qk_bias add and RoPE (+ the KV store) by one Triton kernel

    def forward(self, x, cos, sin, bank: int):
        """x ``[T, n_embd]``; cos, sin ``[T, 1, head_dim / 2]`` float32."""
        t = x.shape[0]
        q, k, v = self.Wqkv(x).split(self.chunks, dim=-1)
        q = q.view(t, self.n_head, self.head_dim)
        k = k.view(t, self.n_kv, self.head_dim)
        v = v.view(t, self.n_kv, self.head_dim)
        if self.fused:
            from latentserve.ops.kernels import apply_rotary_pairs_, apply_rotary_pairs_store_kv_

            bias = self.qk_bias[:, 0] if self.has_qk_bias else (None, None)
            ctx = get_context()
            if ctx.backend.fused_kv_store:  # q in place; rotated k and v into the bank
                apply_rotary_pairs_store_kv_(q, k, v, cos[:, 0], sin[:, 0], ctx.kv_pool.k[bank],
                                             ctx.kv_pool.v[bank], ctx.attn_meta.out_slots,
                                             bias[0], bias[1])
                k = v = None  # in the pool now
            else:
                apply_rotary_pairs_(q, k, cos[:, 0], sin[:, 0], bias[0], bias[1])
        else:
            if self.has_qk_bias:
                q = (q + self.qk_bias[0, 0]).to(q.dtype)
                k = (k + self.qk_bias[1, 0]).to(q.dtype)
            q, k = rope_pairs(q, cos, sin), rope_pairs(k, cos, sin)
        o = paged_attention(bank, q, k, v, self.scale)
        return self.proj(o.reshape(t, -1))


class GatedMLP(nn.Module):
    """One ``fc`` to ``2 * intermediate`` (first half gated by SiLU), then ``proj``."""

    def __init__(self, n_embd: int, intermediate: int):
        super().__init__()
        self.fc = nn.Linear(n_embd, 2 * intermediate, bias=False)
        self.proj = nn.Linear(intermediate, n_embd, bias=False)
        self.fused = False  # SiLU-and-multiply by the Triton kernel

    def forward(self, x):
        if self.fused:
            from latentserve.ops import kernels

            return self.proj(kernels.silu_and_mul(self.fc(x)))
        a, b = self.fc(x).chunk(2, dim=-1)
        return self.proj(F.silu(a) * b)


class SandwichBlock(nn.Module):
    def __init__(self, n_embd, n_head, n_kv, intermediate, eps, qk_bias):
        super().__init__()
        self.norm_1 = RMSNorm(n_embd, eps)
        self.attn = CausalSelfAttention(n_embd, n_head, n_kv, qk_bias)
        self.norm_2 = RMSNorm(n_embd, eps)
        self.mlp = GatedMLP(n_embd, intermediate)
        self.norm_3 = RMSNorm(n_embd, eps)
        self.norm_4 = RMSNorm(n_embd, eps)

    def forward(self, x, cos, sin, bank: int):
        # norm(f(x) + x) as RMSNorm's residual form: one kernel for the add and the norm
        x = self.norm_2(self.attn(self.norm_1(x), cos, sin, bank), x)[0]
        return self.norm_4(self.mlp(self.norm_3(x)), x)[0]


def huginn_config(d: dict):
    """A ``PretrainedConfig`` from Huginn's ``config.json`` dict, with the aliases the engine
    reads (``hidden_size``, ``max_position_embeddings``, ``tie_word_embeddings``)."""
    from transformers import PretrainedConfig

    cfg = PretrainedConfig(**d)
    cfg.model_type = "huginn_raven"
    cfg.hidden_size = d.get("n_embd", 5280)
    heads = d.get("num_attention_heads") or d.get("n_heads") or 55
    cfg.num_attention_heads = heads
    cfg.num_key_value_heads = d.get("num_key_value_heads") or heads
    cfg.max_position_embeddings = d.get("block_size", 4096)
    cfg.tie_word_embeddings = d.get("tie_embeddings", True)
    cfg.vocab_size = d.get("vocab_size", 65536)
    return cfg


class RavenForCausalLM(RecurrentLM):
    """Paged-KV Huginn (``cfg`` from :func:`huginn_config`), per-token depth and exit from
    ``ForwardContext.recurrent``: ``forward(input_ids [T], positions [T], ...)`` ->
    ``[T, n_embd]``; ``compute_logits`` -> ``[B, vocab]`` float32."""

    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        e = self.n_embd = int(cfg.hidden_size)
        heads, kv = int(cfg.num_attention_heads), int(cfg.num_key_value_heads)
        inter = int(cfg.intermediate_size)
        eps = float(getattr(cfg, "norm_eps", 1e-6))
        qk_bias = bool(getattr(cfg, "qk_bias", True))
        for key, ok in (("injection_type", "linear"), ("block_class_name", "SandwichBlock"),
                        ("mlp_class_name", "GatedMLP"), ("nonlin_name", "SiLU")):
            val = getattr(cfg, key, None)
            if val is not None and val != ok:
                raise ValueError(f"Huginn config {key}={val!r} is not supported (only {ok!r})")
        if qk_bias and kv != heads:
            raise ValueError("Huginn qk_bias needs num_key_value_heads == num_attention_heads")
        self.mean_recurrence = int(getattr(cfg, "mean_recurrence", 32))
        head_dim = e // heads
        base = float(getattr(cfg, "rope_base", 50_000.0))
        self.init_depth(cfg, self.mean_recurrence, "mean_recurrence",
                        1.0 / (base ** (torch.arange(0, head_dim, 2) / head_dim)),
                        int(getattr(cfg, "n_layers_in_recurrent_block", 4)),
                        int(getattr(cfg, "n_layers_in_prelude", 2)),
                        int(getattr(cfg, "n_layers_in_coda", 2)))
        vocab = int(cfg.vocab_size)

        def blocks(n):
            return nn.ModuleList(SandwichBlock(e, heads, kv, inter, eps, qk_bias)
                                 for _ in range(n))

        self.transformer = nn.ModuleDict({
            "wte": nn.Embedding(vocab, e),
            "prelude": blocks(self.n_prelude),
            "adapter": nn.Linear(2 * e, e, bias=bool(getattr(cfg, "bias", False))),
            "core_block": blocks(self.n_core),
            "coda": blocks(self.n_coda),
            "ln_f": RMSNorm(e, eps),
        })
        self.lm_head = nn.Linear(e, vocab, bias=False)
        self.tie = bool(cfg.tie_word_embeddings)
        if self.tie:
            self.lm_head.weight = self.transformer.wte.weight
        self.emb_scale = math.sqrt(e)
        # [block_size, n_embd] float32 initial states (upstream initialize_state)
        table = torch.zeros(int(cfg.max_position_embeddings), e)
        std = math.sqrt(2 / (5 * e)) * float(getattr(cfg, "init_scale", 1.0))
        if std > 0:
            g = torch.Generator().manual_seed(int(getattr(cfg, "state_init_seed", 0)))
            torch.nn.init.trunc_normal_(table, mean=0.0, std=std, a=-3 * std, b=3 * std,
                                        generator=g)
            table = table * self.emb_scale
        self.register_buffer("state_table", table, persistent=False)
        self.latent_spec = LatentSpec(kind="recurrent", family="huginn",
                                      default_budget=self.mean_recurrence,
                                      max_budget=self.max_depth)

    def coda_bank(self, j: int) -> int:
        """Pool layer of coda layer ``j``."""
        return self.n_prelude + self.max_depth * self.n_core + j

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.transformer.wte(input_ids)

    def use_fused_ops(self) -> None:
        """Switch to the CUDA fast path (``latentserve.ops.kernels``); call once after
        ``load_weights``; CPU only under ``TRITON_INTERPRET=1``."""
        for m in self.modules():
            if isinstance(m, (RMSNorm, CausalSelfAttention, GatedMLP)):
                m.fused = True

    def rope(self, positions: torch.Tensor):
        """``(cos, sin)``, each ``[T, 1, head_dim / 2]`` float32."""
        freqs = self.freqs(positions)
        return freqs.cos()[:, None, :], freqs.sin()[:, None, :]

    def iterate(self, x, e, cos, sin, t: int):
        """One recurrence: ``core(adapter(cat[x, e]))`` with iteration ``t``'s banks."""
        x = self.transformer.adapter(torch.cat([x, e], dim=-1))
        for l, block in enumerate(self.transformer.core_block):
            x = block(x, cos, sin, self.bank(t, l))
        return x

    def head_hidden(self, x, cos, sin):
        """``ln_f``, coda, ``ln_f`` (upstream ``predict_from_latents`` before the head)."""
        x = self.transformer.ln_f(x)
        for j, block in enumerate(self.transformer.coda):
            x = block(x, cos, sin, self.coda_bank(j))
        return self.transformer.ln_f(x)

    def forward(self, input_ids, positions, input_embeds=None, latent_mask=None):
        ctx = get_context()
        e = inject(self.embed(input_ids), input_embeds, latent_mask) * self.emb_scale
        cos, sin = self.rope(positions)
        for i, block in enumerate(self.transformer.prelude):
            e = block(e, cos, sin, i)
        x = self.state_table.index_select(0, positions).to(e.dtype)
        rb = getattr(ctx, "recurrent", None)
        if rb is not None and rb.compact:
            x = self._recur_compact(x, e, cos, sin, ctx, rb)
        else:  # masked: fixed trip count, no host reads (CUDA-graph path; no upstream rows)
            n = self.mean_recurrence if rb is None else rb.num_iters
            depths = getattr(ctx, "depths", None)
            for t in range(n):
                x_new = self.iterate(x, e, cos, sin, t)
                x = x_new if depths is None else torch.where((depths > t)[:, None], x_new, x)
            self.num_iterations += n * x.shape[0]
        return self.head_hidden(x, cos, sin)

    def _recur_compact(self, x, e, cos, sin, ctx, rb):
        ex = _HuginnExit(self, rb, x) if rb.any_exit else None
        steps = drop = None
        if rb.drop_skipped is not None:  # upstream exit semantics: skipped steps are masked
            steps = slot_steps(ctx.kv_pool)
            steps[rb.out_slots] = rb.token_depths(steps.device).to(steps.dtype)
            drop = torch.tensor(rb.drop_skipped, device=steps.device)

        def mask(act, t, rows, idx):
            sel = drop if idx is None else drop[torch.tensor(rows, device=drop.device)]
            ctx.attn_meta = ctx.backend.mask_keys(ctx.attn_meta, steps > t, sel)

        def exits(act, t, rows, idx, x):
            check = [b for b in rows if rb.eligible[b] and rb.rules[b].is_check_step(t)]
            gone = ex.check(act, check, x, cos, sin) if check else []
            dropped = [b for b in gone if rb.rules[b].upstream]
            if dropped:  # banks > t stay empty: masked for later readers
                steps[act.slots_of(dropped)] = t + 1
            return gone

        return recur_compact(self, ctx, rb, x, (e, cos, sin), self.iterate, exits,
                             mask if steps is not None else None)

    def load_weights(self, weights) -> None:
        """Load upstream-named ``(name, tensor)`` pairs; KeyError on an unexpected name,
        ValueError on a missing one."""

        def rename(name: str) -> str | None:
            for prefix in ("_orig_mod._original_module.", "_orig_mod."):
                name = name.removeprefix(prefix)
            return None if name == "freqs_cis" else name

        load_by_name(self, weights, rename,
                     tied=("lm_head.weight", "transformer.wte.weight") if self.tie else ())


class _HuginnExit:
    """Per-row state of Huginn's exit evaluators for one forward (upstream
    ``PerIterationExitEvaluator``): latent criteria average a row's positions, logit
    criteria read its last."""

    def __init__(self, model: RavenForCausalLM, rb, x0):
        self.model, self.rb = model, rb
        dev = x0.device
        b = len(rb.row_depths)
        self.prev_latent = x0.clone()  # [T, n_embd]
        self.prev_entropy = torch.full((b,), 100.0, device=dev)
        self.vocab = int(model.config.vocab_size)  # lm_head rows (a shard under TP)
        self.prev_logp = None
        if any(r is not None and "kl" in r.criterion for r in rb.rules):
            self.prev_logp = torch.full((b, self.vocab), 1 / self.vocab, device=dev).log()
        self.prev_argmax = torch.full((b,), -1, dtype=torch.int64, device=dev)
        self.stable = torch.zeros(b, dtype=torch.int64, device=dev)
        self.thr = torch.tensor([r.threshold if r is not None else 0.0 for r in rb.rules],
                                dtype=torch.float32).to(dev)

    def _logits(self, act, rows, x, cos, sin):
        """``[len(rows), vocab]`` float32: each row's last position's logits, the coda run
        over all the rows' positions (with the rows' own attention metadata)."""
        idx, meta = act.meta_for(rows)
        ctx = act.ctx
        keep = ctx.attn_meta
        ctx.attn_meta = meta
        try:
            tok = act.token_index(rows) if idx is None else idx
            h = self.model.head_hidden(x[tok], cos[tok], sin[tok])
        finally:
            ctx.attn_meta = keep
        last = torch.cumsum(torch.tensor([self.rb.q_lens[b] for b in rows]), 0) - 1
        return self.model.compute_logits(h[last.to(h.device)])

    def check(self, act: ActiveRows, rows: list[int], x, cos, sin) -> list[int]:
        """Evaluate the rows' criteria on the latents ``x [T, n_embd]``; return the rows
        that exit now (one host read)."""
        rules = self.rb.rules
        dev = x.device
        logit_rows = [b for b in rows if rules[b].criterion in HUGINN_LOGIT_CRITERIA]
        logits = self._logits(act, logit_rows, x, cos, sin) if logit_rows else None
        lpos = {b: i for i, b in enumerate(logit_rows)}
        order, flags = [], []  # rows, their exit flags
        for crit in sorted({rules[b].criterion for b in rows}):
            g = [b for b in rows if rules[b].criterion == crit]
            ri = torch.tensor(g, dtype=torch.int64, device=dev)
            thr = self.thr[ri]
            if crit in HUGINN_LOGIT_CRITERIA:
                lg = logits[torch.tensor([lpos[b] for b in g], device=dev)]
            if crit in ("latent-diff", "cosine"):
                tok = act.token_index(g)
                lat, prev = x[tok], self.prev_latent[tok]
                if crit == "latent-diff":
                    per = (lat - prev).norm(dim=-1) / lat.norm(dim=-1)
                else:
                    per = (lat * prev).sum(-1) / lat.norm(dim=-1) / prev.norm(dim=-1)
                # a row's value: the mean over its positions (upstream's block-wide mean)
                val = torch.stack([v.mean() for v in per.split([self.rb.q_lens[b] for b in g])])
                if crit == "cosine":
                    val = 1 - val
                self.prev_latent[tok] = lat
            elif crit == "entropy-diff":
                probs = F.softmax(lg, dim=-1)
                ent = -torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
                val = (ent - self.prev_entropy[ri]).abs()
                self.prev_entropy[ri] = ent
            elif crit in ("kl", "minp-kl"):
                if crit == "kl":
                    logp = F.log_softmax(lg.float(), dim=-1)
                else:
                    probs = F.softmax(lg, dim=-1)
                    top = probs.max(dim=-1, keepdim=True)[0]
                    probs = torch.where(probs < 0.1 * top, 1 / self.vocab, probs)
                    logp = (probs / probs.sum(dim=-1, keepdim=True)).log()
                val = F.kl_div(logp, self.prev_logp[ri], reduction="none",
                               log_target=True).sum(dim=-1)
                self.prev_logp[ri] = logp
            else:  # argmax-stability
                am = lg.argmax(dim=-1)
                stable = torch.where(am == self.prev_argmax[ri], self.stable[ri] + 1, 0)
                self.prev_argmax[ri], self.stable[ri] = am, stable
            order += g
            flags.append(stable >= thr if crit == "argmax-stability" else val < thr)
        # the one host read per check
        return [b for b, f in zip(order, torch.cat(flags).tolist()) if f]
