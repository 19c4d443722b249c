"""Eager per-request references for Huginn and Ouro over plain torch and the checkpoint's own
files (``config.json``, ``model.safetensors``), from the upstream algorithms.

Design notes: docs/internals.md, "latentserve.bench.baseline.recurrent_reference".
"""

from __future__ import annotations

import json
import math
from pathlib import Path

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


def _attend(q, keys, vals, q_pos, scale, k_pos):
    """Causal attention of queries ``q [S, H, D]`` at positions ``q_pos`` over ``keys, vals
    [P, Hkv, D]`` at positions ``k_pos``. Returns ``[S, H, D]``."""
    rep = q.shape[1] // keys.shape[1]
    k = keys.repeat_interleave(rep, dim=1).transpose(0, 1)  # [H, P, D]
    v = vals.repeat_interleave(rep, dim=1).transpose(0, 1)
    s = torch.einsum("shd,hpd->hsp", q.float(), k.float()) * scale
    dev = keys.device
    visible = torch.tensor(k_pos, device=dev)[None, :] <= torch.tensor(q_pos, device=dev)[:, None]
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
    iteration of the same looped layer: ``latest-m4``); empty for indices never skipped.
    ``update`` returns ``(keys, values, their positions)``."""

    def __init__(self, same_layer):
        self.kv: dict[int, dict[int, tuple]] = {}
        self.same_layer = same_layer

    def update(self, idx, positions, k, v):
        slot = self.kv.setdefault(idx, {})
        slot.update((p, (k[i], v[i])) for i, p in enumerate(positions))
        return self._rows(idx, slot, max(positions) + 1)

    def _rows(self, idx, slot, n):
        ks, vs = zip(*(slot.get(p) or next(self.kv[j][p] for j in self.same_layer(idx)
                                           if p in self.kv.get(j, {})) for p in range(n)))
        return torch.stack(ks), torch.stack(vs), list(range(n))


class HuginnReference:
    """Upstream Huginn inference for one request at a time (see the module docstring)."""

    def __init__(self, model_dir, dtype=torch.float32, device="cpu"):
        c, sd = load_checkpoint(model_dir)
        self.sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()
                   if k != "freqs_cis"}
        self.e = c["n_embd"]
        self.h = c.get("num_attention_heads") or c["n_heads"]
        self.hkv = c.get("num_key_value_heads") or self.h
        self.hd = self.e // self.h
        self.p, self.l = c["n_layers_in_prelude"], c["n_layers_in_recurrent_block"]
        self.c = c["n_layers_in_coda"]
        self.eps = c.get("norm_eps", 1e-6)
        self.qk_bias = c.get("qk_bias", True)
        self.emb_scale = math.sqrt(self.e)
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

    def _forward(self, ids, pos, cache, num_steps, check=None):
        """Logits ``[vocab]`` of the last position and the iterations run. ``check(step,
        x)`` after each iteration: None goes on, logits ``[S, vocab]`` stop there."""
        e = self.sd["transformer.wte.weight"][ids] * self.emb_scale
        for i in range(self.p):
            e = self._block(f"transformer.prelude.{i}", e, pos, cache, i)
        x = self.state[pos]
        for step in range(num_steps):
            x = torch.cat([x, e], dim=-1) @ self.sd["transformer.adapter.weight"].T
            for l in range(self.l):
                x = self._block(f"transformer.core_block.{l}", x, pos, cache,
                                self.p + step * self.l + l)
            logits = check(step, x) if check else None
            if logits is not None:
                return logits[-1], step + 1
        return self._predict(x, pos, cache)[-1], num_steps

    @torch.no_grad()
    def generate(self, prompt, max_tokens, num_steps) -> dict:
        """Greedy generation at ``num_steps`` iterations per token (module docstring)."""
        cache = _LayeredCache(self._same_layer)
        return _greedy(lambda ids, pos, first: self._forward(ids, pos, cache, num_steps),
                       prompt, max_tokens, ("iterations",))


class OuroReference:
    """Upstream Ouro inference for one request at a time (see the module docstring)."""

    def __init__(self, model_dir, dtype=torch.float32, device="cpu"):
        c, sd = load_checkpoint(model_dir)
        self.sd = {k: v.to(device=device, dtype=dtype) for k, v in sd.items()}
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
        keys, vals, kpos = cache.update(idx, pos, k, v)
        o = _attend(q, keys, vals, pos, self.hd**-0.5, kpos).reshape(s, -1)
        a = o @ w[f"{pre}.self_attn.o_proj.weight"].T
        x = x + _rms(a, w[f"{pre}.input_layernorm_2.weight"], self.eps)
        hx = _rms(x, w[f"{pre}.post_attention_layernorm.weight"], self.eps)
        m = (F.silu(hx @ w[f"{pre}.mlp.gate_proj.weight"].T)
             * (hx @ w[f"{pre}.mlp.up_proj.weight"].T)) @ w[f"{pre}.mlp.down_proj.weight"].T
        return x + _rms(m, w[f"{pre}.post_attention_layernorm_2.weight"], self.eps)

    def _same_layer(self, idx):
        return list(range(idx - self.n, -1, -self.n))

    def _steps(self, ids, pos, cache, depth):
        """The hidden states ``[S, hidden]`` after each of ``depth`` loops (after ``norm``)."""
        h = self.sd["model.embed_tokens.weight"][ids]
        freqs = torch.tensor(pos, dtype=torch.float32, device=h.device)[:, None] \
            * self.inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(h.dtype)[:, None, :], emb.sin().to(h.dtype)[:, None, :]
        for t in range(depth):
            for i in range(self.n):
                h = self._layer(i, h, pos, cos, sin, cache, t * self.n + i)
            h = _rms(h, self.sd["model.norm.weight"], self.eps)
            yield h

    @torch.no_grad()
    def generate(self, prompt, max_tokens, depth=None) -> dict:
        """Greedy generation at ``depth`` loops per token (default ``total_ut_steps``), read
        out from the last loop (module docstring)."""
        depth = depth or self.steps
        cache = _LayeredCache(self._same_layer)

        def forward(ids, pos, first):
            *_, h = self._steps(ids, pos, cache, depth)
            return (h @ self.sd["lm_head.weight"].T)[-1].float(), depth

        return _greedy(forward, prompt, max_tokens, ("iterations",))
