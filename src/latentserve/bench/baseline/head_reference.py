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


def _mlp(sd: dict, prefix: str, device: str) -> nn.Sequential:
    """A float32 Linear/SiLU stack on ``device`` from ``prefix{0,2,4}.weight`` tensors (the
    addon's layout)."""
    sub = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    layers: list[nn.Module] = []
    while f"{len(layers)}.weight" in sub:
        w = sub[f"{len(layers)}.weight"]
        layers += [nn.Linear(w.shape[1], w.shape[0], bias=f"{len(layers)}.bias" in sub),
                   nn.SiLU()]
    net = nn.Sequential(*layers[:-1])
    net.load_state_dict(sub)
    return net.float().to(device).eval()


def load_bundle_reference(path, device: str = "cpu"
                          ) -> tuple[dict, nn.Module, nn.Module | None, nn.Module]:
    """``(config, head_net, stop_net or None, decoder_net)`` from a bundle file, on ``device``."""
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
    stop = (_mlp(flat, "reasoning_head.stop_head.", device)
            if "reasoning_head.stop_head.0.weight" in flat else None)
    return cfg, _mlp(flat, "reasoning_head.net.", device), stop, _mlp(flat, "decoder.net.", device)


@lru_cache(maxsize=4)
def _hf_model(model_dir: str, dtype: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)).to(device).eval()


_bundle_cached = lru_cache(maxsize=4)(load_bundle_reference)


class HeadReference:
    """One greedy request (``generate``): ``model_dir``'s HF model in ``dtype`` with
    ``bundle_path``'s nets in float32 (re-read unless ``reuse_bundle``), closed-loop injection
    without a stop decision."""

    def __init__(self, model_dir, bundle_path, dtype: str = "float32", device: str = "cpu",
                 reuse_bundle: bool = False):
        self.model = _hf_model(str(model_dir), dtype, device)
        load = _bundle_cached if reuse_bundle else load_bundle_reference
        self.cfg, self.head_net, self.stop_net, self.dec_net = load(str(bundle_path), device)
        self.emb, self.device, self.past = self.model.get_input_embeddings(), device, None

    def run(self, embeds):
        """Feed ``embeds [T, H]``: ``(last logits [V] float32, anchor [H])``."""
        out = self.model(inputs_embeds=embeds[None], past_key_values=self.past, use_cache=True,
                         output_hidden_states=True)
        self.past = out.past_key_values
        return out.logits[0, -1].float(), out.hidden_states[self.cfg["source_layer"] + 1][0, -1]

    def embed(self, ids):
        return self.emb(torch.tensor(list(ids), device=self.device))

    def decode(self, anchor):
        """The latent input embedding of ``anchor``: ``decoder(LN(head(LN(anchor)).mu))``."""
        hid, lat = self.cfg["hidden_size"], self.cfg["latent_dim"]
        mu = self.head_net(F.layer_norm(anchor.float(), (hid,)))[..., :lat]
        return self.dec_net(F.layer_norm(mu, (lat,)))

    def stops(self, res: dict, anchor) -> bool:
        """Whether the latent phase ends before step ``res["steps"]``: never here."""
        return False

    def think(self, res: dict, ids, close_ids, max_latent: int, max_tokens: int):
        """Prefill ``ids``, latent steps until :meth:`stops` or ``max_latent`` ("cap"), the
        closing ids: ``(logits, output tokens spent)``, None when ``max_tokens`` ran out."""
        logits, anchor = self.run(self.embed(ids))
        while not self.stops(res, anchor):
            if res["steps"] >= max_latent:
                res["end"] = "cap"
                break
            logits, anchor = self.run(self.decode(anchor).to(self.emb.weight.dtype)[None])
            res["steps"] += 1
            if res["steps"] >= max_tokens:
                res["end"] = "length"
                return None
        logits, _ = self.run(self.embed(close_ids))
        spent = res["steps"] + len(close_ids)
        return None if spent >= max_tokens else (logits, spent)

    @torch.no_grad()
    def generate(self, prompt_ids: list[int], open_ids, close_ids, max_latent: int = 8,
                 max_tokens: int = 16, eos_ids=()) -> dict:
        """``{"tokens", "steps", "stop_step", "max_stop_prob", "end", "finish_reason"}``;
        ``open_ids`` appended unless the prompt ends with them, ``eos_ids`` end the answer
        (kept). Latent steps, closing ids and answer tokens count against ``max_tokens``."""
        ids = list(prompt_ids)
        if ids[-len(open_ids):] != list(open_ids):
            ids += list(open_ids)
        res = {"steps": 0, "stop_step": None, "max_stop_prob": None, "end": None,
               "tokens": [], "finish_reason": "length"}
        thought = self.think(res, ids, close_ids, max_latent, max_tokens)
        if thought is None:
            return res
        logits, spent = thought
        while True:
            tok = int(logits.argmax())
            res["tokens"].append(tok)
            spent += 1
            if tok in eos_ids:
                res["finish_reason"] = "stop"
                break
            if spent >= max_tokens:
                break
            logits, _ = self.run(self.embed([tok]))
        return res
