"""The eager single-request reference for compression heads over HF transformers, reading the
bundle itself (CoLaR, arXiv 2505.16552; the DeepSeek-V4 addon's ``closed_loop.py``).

Design notes: docs/internals.md, "latentserve.bench.baseline.head_reference".
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn


def _mlp(sd: dict, prefix: str) -> nn.Sequential:
    """A Linear/SiLU stack from ``prefix{0,2,4}.weight`` tensors (the addon's layout)."""
    sub = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    layers: list[nn.Module] = []
    while f"{len(layers)}.weight" in sub:
        w = sub[f"{len(layers)}.weight"]
        layers += [nn.Linear(w.shape[1], w.shape[0], bias=f"{len(layers)}.bias" in sub),
                   nn.SiLU()]
    net = nn.Sequential(*layers[:-1])
    net.load_state_dict(sub)
    return net.float().eval()


def load_bundle_reference(path) -> tuple[dict, nn.Module, nn.Module | None, nn.Module]:
    """``(config, head_net, stop_net or None, decoder_net)`` from a bundle file."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            cfg, flat = f.metadata()["config"], {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    else:
        d = torch.load(path, map_location="cpu", weights_only=True)
        cfg, flat = d["config"], {f"{part}.{k}": v for part in ("reasoning_head", "decoder")
                                  for k, v in d[part].items()}
    cfg = cfg if isinstance(cfg, dict) else json.loads(cfg)
    stop = (_mlp(flat, "reasoning_head.stop_head.")
            if "reasoning_head.stop_head.0.weight" in flat else None)
    return cfg, _mlp(flat, "reasoning_head.net."), stop, _mlp(flat, "decoder.net.")


@lru_cache(maxsize=4)
def _hf_model(model_dir: str, dtype: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)).to(device).eval()


def _bundle_on(path: str, device: str):
    """``load_bundle_reference(path)`` with its modules on ``device``."""
    cfg, head_net, stop_net, dec_net = load_bundle_reference(path)
    return (cfg, head_net.to(device), None if stop_net is None else stop_net.to(device),
            dec_net.to(device))


_bundle_cached = lru_cache(maxsize=4)(_bundle_on)


@torch.no_grad()
def head_reference_generate(model_dir, bundle_path, prompt_ids: list[int], open_ids, close_ids,
                            *, mode: str = "closed_loop", max_latent: int = 8,
                            min_latent: int = 0, use_stop: bool = True,
                            stop_threshold: float = 0.5, max_tokens: int = 16,
                            eos_ids=(), dtype: str = "float32", device: str = "cpu",
                            reuse_bundle: bool = False) -> dict:
    """One greedy request -> ``{"tokens", "steps", "stop_step", "max_stop_prob", "end",
    "finish_reason"}``; ``open_ids`` appended unless the prompt ends with them, ``eos_ids``
    end the answer (kept). Backbone in ``dtype``, head in float32; the bundle re-read per
    call unless ``reuse_bundle``."""
    model = _hf_model(str(model_dir), dtype, device)
    load = _bundle_cached if reuse_bundle else _bundle_on
    cfg, head_net, stop_net, dec_net = load(str(bundle_path), device)
    src, hid, lat = cfg["source_layer"], cfg["hidden_size"], cfg["latent_dim"]
    emb = model.get_input_embeddings()
    ids = list(prompt_ids)
    if ids[-len(open_ids):] != list(open_ids):
        ids += list(open_ids)
    past = None

    def run(embeds):  # [T, H] -> (last logits [V] float32, anchor [H])
        nonlocal past
        out = model(inputs_embeds=embeds[None], past_key_values=past, use_cache=True,
                    output_hidden_states=True)
        past = out.past_key_values
        return out.logits[0, -1].float(), out.hidden_states[src + 1][0, -1]

    def decode(anchor):
        mu = head_net(F.layer_norm(anchor.float(), (hid,)))[..., :lat]
        return dec_net(F.layer_norm(mu, (lat,)))

    def stop_p(anchor):
        if stop_net is None:
            return None
        return float(torch.sigmoid(stop_net(F.layer_norm(anchor.float(), (hid,))))[0])

    res = {"steps": 0, "stop_step": None, "max_stop_prob": None, "end": None}
    n_out = 0
    logits, anchor = run(emb(torch.tensor(ids, device=device)))
    if mode == "prompt":
        embeds = emb(torch.tensor(ids, device=device)).clone()
        embeds[-1] = decode(anchor).to(embeds.dtype)
        past = None
        logits, anchor = run(embeds)
        res.update(steps=1, end="prompt")
    else:
        use_stop = use_stop and stop_net is not None
        while True:
            k, p = res["steps"], stop_p(anchor)
            if p is not None:
                m = res["max_stop_prob"]
                res["max_stop_prob"] = p if m is None else max(m, p)
            if use_stop and k >= min_latent and p > stop_threshold:
                res.update(end="stop", stop_step=k)
                break
            if k >= max_latent:
                res["end"] = "cap"
                break
            vec = decode(anchor).to(emb.weight.dtype)
            logits, anchor = run(vec[None])
            res["steps"] += 1
            n_out += 1
            if n_out >= max_tokens:
                res.update(end="length", tokens=[], finish_reason="length")
                return res
        logits, anchor = run(emb(torch.tensor(list(close_ids), device=device)))
        n_out += len(close_ids)
        if n_out >= max_tokens:  # the closing ids spent the rest of the budget
            res.update(tokens=[], finish_reason="length")
            return res
    answer, reason = [], "length"
    while True:
        tok = int(logits.argmax())
        answer.append(tok)
        n_out += 1
        if tok in eos_ids:
            reason = "stop"
            break
        if n_out >= max_tokens:
            break
        logits, anchor = run(emb(torch.tensor([tok], device=device)))
    res.update(tokens=answer, finish_reason=reason)
    return res
