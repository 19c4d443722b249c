"""Eager per-request references for Huginn and Ouro over plain torch and the checkpoint's own
files (``config.json``, ``model.safetensors``), from the upstream algorithms.

Design notes: docs/internals.md, "latentserve.bench.baseline.recurrent_reference".
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F


def load_checkpoint(model_dir) -> tuple[dict, dict]:
    """``(config.json as a dict, {name: tensor})`` from ``model_dir`` (tensors on the CPU)."""
    from safetensors.torch import load_file

    d = Path(model_dir)
    return json.loads((d / "config.json").read_text()), load_file(str(d / "model.safetensors"))


def _rms(x, w, eps):
    """Upstream RMSNorm: normalize in fp32, back to x's dtype, times the weight."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).type_as(x) * w


def _attend(q, keys, vals, q_pos, scale, k_pos=None):
    """Causal attention of queries ``q [S, H, D]`` at positions ``q_pos`` over ``keys, vals
    [P, Hkv, D]`` at positions ``k_pos`` (None: ``0 .. P-1``). Returns ``[S, H, D]``."""
    rep = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, P, D]
    v = vals.repeat_interleave(rep, dim=1).transpose(0, 1)
    s = torch.einsum("shd,hpd->hsp", q.float(), k.float()) * scale
    dev = keys.device
    kp = torch.arange(keys.shape[0], device=dev) if k_pos is None else \
        torch.tensor(k_pos, device=dev)
    visible = kp[None, :] <= torch.tensor(q_pos, device=dev)[:, None]
    s = s.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hsp,hpd->shd", s.softmax(-1), v.float()).to(q.dtype)


def _greedy(forward, prompt, max_tokens: int, keys: tuple[str, ...]) -> dict:
    """Greedy tokens after ``prompt``: ``forward(ids, positions, first)`` gives the last
    position's logits ``[vocab]`` then the values named ``keys``. Returns ``{"tokens",
    "logits", *keys}``, one entry per token."""
    ids = list(prompt)
    out: dict[str, list] = {k: [] for k in ("tokens", "logits", *keys)}
    res = forward(ids, list(range(len(ids))), True)
    for i in range(max_tokens):
        ids.append(int(res[0].argmax()))
        for k, v in zip(out, (ids[-1], *res)):
            out[k].append(v)
        if i + 1 < max_tokens:
            res = forward([ids[-1]], [len(ids) - 1], False)
    return out


class _LayeredCache:
    """KV per cache index, each a dict position -> (k, v) ``[Hkv, D]``. ``same_layer(idx)``
    lists, newest first, the indices a missing position may fall back to (the latest
    iteration of the same looped layer); empty for indices that are never skipped.
    ``drop``: upstream ``HuginnDynamicCache``'s default ``full`` lookup instead, which
    returns only the positions present at the index (a missing one is left out).
    ``update`` returns ``(keys, values, their positions)``."""

    def __init__(self, same_layer, drop=False):
        self.kv: dict[int, dict[int, tuple]] = {}
        self.same_layer = same_layer
        self.drop = drop

    def update(self, idx, positions, k, v):
        slot = self.kv.setdefault(idx, {})
        for i, p in enumerate(positions):
            slot[p] = (k[i], v[i])
        if self.drop:  # "full": stack the entries present, in position order
            kept = sorted(slot)
            return (torch.stack([slot[p][0] for p in kept]),
                    torch.stack([slot[p][1] for p in kept]), kept)
        n = max(positions) + 1
        ks, vs = [], []
        for p in range(n):
            entry = slot.get(p)
            if entry is None:  # latest-m4: latest same-layer step that has this position
                entry = next(self.kv[j][p] for j in self.same_layer(idx)
                             if j in self.kv and p in self.kv[j])
            ks.append(entry[0])
            vs.append(entry[1])
        return torch.stack(ks), torch.stack(vs), None


class HuginnReference:
    """Upstream Huginn inference for one request at a time (see the module docstring)."""

    # upstream get_adaptive_exit_evaluator's "auto" thresholds
    AUTO: ClassVar[dict] = {"entropy-diff": 1e-3, "latent-diff": 0.03, "kl": 1e-3,
                            "minp-kl": 1e-5, "argmax-stability": 5, "cosine": 1e-3}

    def __init__(self, model_dir, dtype=torch.float32, device="cpu"):
        c, sd = load_checkpoint(model_dir)
        self.sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()
                   if k != "freqs_cis"}
        self.device = torch.device(device)
        self.e = c["n_embd"]
        self.h = c.get("num_attention_heads") or c["n_heads"]
        self.hkv = c.get("num_key_value_heads") or self.h
        self.hd = self.e // self.h
        self.p, self.l = c["n_layers_in_prelude"], c["n_layers_in_recurrent_block"]
        self.c = c["n_layers_in_coda"]
        self.eps = c.get("norm_eps", 1e-6)
        self.qk_bias = c.get("qk_bias", True)
        self.emb_scale = math.sqrt(self.e)
        self.vocab = c["vocab_size"]
        block = c.get("block_size", 4096)
        base = c.get("rope_base", 50000.0)
        inv = 1.0 / (base ** (torch.arange(0, self.hd, 2, dtype=torch.float32) / self.hd))
        freqs = torch.outer(torch.arange(block, dtype=torch.float32), inv)
        self.cos, self.sin = freqs.cos().to(device), freqs.sin().to(device)
        # Initial states: trunc_normal(std = sqrt(2 / (5 n_embd)) * init_scale, +-3 std)
        # * sqrt(n_embd), one row per position, from Generator(state_init_seed).
        std = math.sqrt(2 / (5 * self.e)) * c.get("init_scale", 1.0)
        table = torch.zeros(block, self.e)
        if std > 0:
            g = torch.Generator().manual_seed(c.get("state_init_seed", 0))
            torch.nn.init.trunc_normal_(table, 0.0, std, -3 * std, 3 * std, generator=g)
            table = table * self.emb_scale
        self.state = table.to(device=device, dtype=dtype)

    def _block(self, pre, x, pos, cache, step):
        w = self.sd
        s = x.shape[0]
        hx = _rms(x, w[f"{pre}.norm_1.weight"], self.eps)
        q, k, v = (hx @ w[f"{pre}.attn.Wqkv.weight"].T).split(
            [self.e, self.hkv * self.hd, self.hkv * self.hd], dim=-1)
        q, k, v = (t.view(s, -1, self.hd) for t in (q, k, v))
        if self.qk_bias:
            b = w[f"{pre}.attn.qk_bias"]
            q, k = q + b[0, 0], k + b[1, 0]
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]

        def rot(t):  # complex-like: interleaved pairs, fp32
            tr = t.float().unflatten(-1, (-1, 2))
            a, bb = tr[..., 0], tr[..., 1]
            return torch.stack([a * cos - bb * sin, bb * cos + a * sin], -1).flatten(-2) \
                .type_as(t)

        q, k = rot(q), rot(k)
        keys, vals, kpos = cache.update(step, pos, k, v)
        o = _attend(q, keys, vals, pos, self.hd**-0.5, kpos).reshape(s, self.e)
        x = _rms(o @ w[f"{pre}.attn.proj.weight"].T + x, w[f"{pre}.norm_2.weight"], self.eps)
        a, g = (_rms(x, w[f"{pre}.norm_3.weight"], self.eps) @ w[f"{pre}.mlp.fc.weight"].T) \
            .chunk(2, dim=-1)
        m = (F.silu(a) * g) @ w[f"{pre}.mlp.proj.weight"].T
        return _rms(m + x, w[f"{pre}.norm_4.weight"], self.eps)

    def _same_layer(self, idx):
        return [] if idx < self.p else list(range(idx - self.l, self.p - 1, -self.l))

    def _predict(self, x, pos, cache):
        """``predict_from_latents``: ln_f, coda (cache -1, -2, ...), ln_f, lm_head."""
        x = _rms(x, self.sd["transformer.ln_f.weight"], self.eps)
        for j in range(self.c):
            x = self._block(f"transformer.coda.{j}", x, pos, cache, -(j + 1))
        x = _rms(x, self.sd["transformer.ln_f.weight"], self.eps)
        return (x @ self.sd["lm_head.weight"].T).float()

    def _forward(self, ids, pos, cache, num_steps, rule):
        """Logits ``[vocab]`` of the last position and the iterations run."""
        e = self.sd["transformer.wte.weight"][ids] * self.emb_scale
        for i in range(self.p):
            e = self._block(f"transformer.prelude.{i}", e, pos, cache, i)
        x = self.state[pos]
        crit, thr, min_steps, every = rule if rule else (None, None, 0, 1)
        dev = self.device
        st = {"prev_latent": x.clone(), "prev_entropy": torch.tensor([100.0], device=dev),
              "prev_logp": torch.full((1, self.vocab), 1 / self.vocab, device=dev).log(),
              "argmax": torch.tensor([-1], device=dev), "stable": torch.tensor([0], device=dev)}
        for step in range(num_steps):
            x = torch.cat([x, e], dim=-1) @ self.sd["transformer.adapter.weight"].T
            for l in range(self.l):
                x = self._block(f"transformer.core_block.{l}", x, pos, cache,
                                self.p + step * self.l + l)
            if crit is None or step < min_steps or (step - min_steps) % every:
                continue
            stop, logits = self._check(crit, thr, x, pos, cache, st)
            if stop:
                if logits is None:
                    logits = self._predict(x, pos, cache)
                return logits[-1], step + 1
        return self._predict(x, pos, cache)[-1], num_steps

    def _check(self, crit, thr, x, pos, cache, st):
        """Upstream exit evaluators at batch size 1: ``(exit, logits or None)``."""
        if crit == "latent-diff":
            val = ((x - st["prev_latent"]).norm(dim=-1) / x.norm(dim=-1)).mean(dim=-1)
            st["prev_latent"] = x.clone()
            return bool(val < thr), None
        if crit == "cosine":
            cos = ((x * st["prev_latent"]).sum(-1) / x.norm(dim=-1)
                   / st["prev_latent"].norm(dim=-1)).mean()
            st["prev_latent"] = x.clone()
            return bool(1 - cos < thr), None
        logits = self._predict(x, pos, cache)
        last = logits[-1:]
        if crit == "entropy-diff":
            probs = F.softmax(last, dim=-1)
            ent = -torch.sum(probs * torch.log(probs + 1e-10), dim=-1)
            val = (ent - st["prev_entropy"]).abs()
            st["prev_entropy"] = ent
            return bool(val < thr), logits
        if crit in ("kl", "minp-kl"):
            if crit == "kl":
                logp = F.log_softmax(last.float(), dim=-1)
            else:
                probs = F.softmax(last, dim=-1)
                mask = probs < 0.1 * probs.max(dim=-1, keepdim=True)[0]
                probs = probs.clone()
                probs[mask] = 1 / self.vocab
                logp = (probs / probs.sum(dim=-1, keepdim=True)).log()
            val = F.kl_div(logp, st["prev_logp"], reduction="none", log_target=True).sum(-1)
            st["prev_logp"] = logp
            return bool(val < thr), logits
        if crit == "argmax-stability":
            am = last.argmax(dim=-1)
            st["stable"] = torch.where(am == st["argmax"], st["stable"] + 1, 0)
            st["argmax"] = am
            return bool(st["stable"] >= thr), logits
        raise ValueError(f"unknown criterion {crit!r}")

    @torch.no_grad()
    def generate(self, prompt, max_tokens, num_steps, criterion=None, threshold="auto",
                 min_steps=0, check_every=1, semantics="engine") -> dict:
        """Greedy generation (module docstring). ``semantics``: ``"engine"`` (the prompt
        at full depth, ``do_not_exit_in_prefill``; ``latest-m4`` lookup) or ``"upstream"``
        (upstream ``generate_with_adaptive_compute``'s defaults: the prompt is checked as
        one block, ``token_step_in_sequence == 0`` included, and the cache's ``full``
        lookup leaves positions without K/V at a step out of that step's attention)."""
        if semantics not in ("engine", "upstream"):
            raise ValueError(f"semantics must be 'engine' or 'upstream', got {semantics!r}")
        rule = None
        if criterion not in (None, "none"):
            thr = self.AUTO[criterion] if threshold == "auto" else threshold
            rule = (criterion, thr, min_steps, check_every)
        upstream = semantics == "upstream"
        cache = _LayeredCache(self._same_layer, drop=upstream)
        return _greedy(lambda ids, pos, first: self._forward(
            ids, pos, cache, num_steps, rule if upstream or not first else None),
            prompt, max_tokens, ("iterations",))


class OuroReference:
    """Upstream Ouro inference for one request at a time (see the module docstring)."""

    def __init__(self, model_dir, dtype=torch.float32, device="cpu"):
        c, sd = load_checkpoint(model_dir)
        self.sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
        self.device = torch.device(device)
        self.hid = c["hidden_size"]
        self.hd = c.get("head_dim") or self.hid // c["num_attention_heads"]
        self.n = c["num_hidden_layers"]
        self.eps = c["rms_norm_eps"]
        theta = c.get("rope_theta", 10000.0)
        self.inv = 1.0 / (theta ** (torch.arange(0, self.hd, 2, dtype=torch.int64).float()
                                    / self.hd)).to(device)
        self.steps = c.get("total_ut_steps", 4)

    def _layer(self, i, x, pos, cos, sin, cache, idx):
        w, pre, s = self.sd, f"model.layers.{i}", x.shape[0]
        hx = _rms(x, w[f"{pre}.input_layernorm.weight"], self.eps)
        q, k, v = ((hx @ w[f"{pre}.self_attn.{n}_proj.weight"].T).view(s, -1, self.hd)
                   for n in "qkv")

        def rot(t):
            half = t.shape[-1] // 2
            return t * cos + torch.cat((-t[..., half:], t[..., :half]), -1) * sin

        q, k = rot(q), rot(k)
        keys, vals, _ = cache.update(idx, pos, k, v)
        o = _attend(q, keys, vals, pos, self.hd**-0.5).reshape(s, -1)
        a = o @ w[f"{pre}.self_attn.o_proj.weight"].T
        x = x + _rms(a, w[f"{pre}.input_layernorm_2.weight"], self.eps)
        hx = _rms(x, w[f"{pre}.post_attention_layernorm.weight"], self.eps)
        m = (F.silu(hx @ w[f"{pre}.mlp.gate_proj.weight"].T)
             * (hx @ w[f"{pre}.mlp.up_proj.weight"].T)) @ w[f"{pre}.mlp.down_proj.weight"].T
        return x + _rms(m, w[f"{pre}.post_attention_layernorm_2.weight"], self.eps)

    def _same_layer(self, idx):
        return list(range(idx - self.n, -1, -self.n))

    def _forward(self, ids, pos, cache, depth, mode, thr, may_stop):
        h = self.sd["model.embed_tokens.weight"][ids]
        freqs = torch.tensor(pos, dtype=torch.float32, device=self.device)[:, None] \
            * self.inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(h.dtype)[:, None, :], emb.sin().to(h.dtype)[:, None, :]
        hs, gates = [], []
        rem = torch.ones(h.shape[0], dtype=h.dtype, device=h.device)
        cum = torch.zeros(h.shape[0], dtype=h.dtype, device=h.device)
        for t in range(depth):
            for i in range(self.n):
                h = self._layer(i, h, pos, cos, sin, cache, t * self.n + i)
            h = _rms(h, self.sd["model.norm.weight"], self.eps)
            hs.append(h)
            g = (h @ self.sd["model.early_exit_gate.weight"].T
                 + self.sd["model.early_exit_gate.bias"])
            gates.append(g)
            if may_stop and t < depth - 1:  # threshold-approx: stop at the exit step
                lam = torch.sigmoid(g.squeeze(-1))
                cum = cum + lam * rem
                rem = rem * (1 - lam)
                if bool(cum[-1] >= thr):
                    return ((h[-1] @ self.sd["lm_head.weight"].T).float(), t + 1, t,
                            self._exit_pdf(gates)[-1].tolist())
        pdf = self._exit_pdf(gates)
        head = self.sd["lm_head.weight"]
        readout = depth - 1
        if mode in ("threshold", "threshold-approx"):
            mask = torch.cumsum(pdf, dim=-1) >= thr
            exit_steps = torch.argmax(mask.float(), dim=-1)
            exit_steps[~mask.any(dim=-1)] = pdf.shape[-1] - 1
            hidden = torch.stack(hs, dim=1)[torch.arange(len(ids), device=h.device), exit_steps]
            logits = hidden @ head.T
            readout = int(exit_steps[-1])
        elif mode == "weighted":
            logits = sum((hh @ head.T) * pdf[:, t:t + 1] for t, hh in enumerate(hs))
            readout = None
        else:
            logits = hs[-1] @ head.T
        return logits[-1].float(), depth, readout, pdf[-1].tolist()

    @staticmethod
    def _exit_pdf(gates):
        """``[S, steps]`` exit pdf from the gate logits of each step (``[S, 1]`` each), as
        upstream ``OuroForCausalLM.forward``: ``p_i = sigmoid(g_i) * prod_{j<i}(1 -
        sigmoid(g_j))``, the last step takes the remaining mass."""
        pdf, rem = [], torch.ones_like(gates[0].squeeze(-1))
        for i, g in enumerate(gates):
            lam = torch.sigmoid(g.squeeze(-1))
            if i < len(gates) - 1:
                p = lam * rem
                rem = rem * (1.0 - lam)
            else:
                p = rem
            pdf.append(p)
        return torch.stack(pdf, dim=-1)

    @torch.no_grad()
    def generate(self, prompt, max_tokens, depth=None, mode="last", threshold=None) -> dict:
        depth = depth or self.steps
        thr = 1.0 if threshold is None else threshold
        cache = _LayeredCache(self._same_layer)
        return _greedy(lambda ids, pos, first: self._forward(
            ids, pos, cache, depth, mode, thr, not first and mode == "threshold-approx"),
            prompt, max_tokens, ("iterations", "readouts", "exit_probs"))
