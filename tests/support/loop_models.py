"""Tiny LOTUS and looped-block checkpoints and the LOTUS eager reference, for tests. PCCoT's
upstream-form builder and the loop reference itself are ``latentserve.bench.baseline.loop_*``
(the benchmarks use them)."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import torch

from latentserve.bench.baseline.loop_models import write_upstream_pccot
from latentserve.bench.baseline.loop_reference import LoopReference, _eos

LOOP_KINDS = ("pccot-gpt2", "pccot-llama", "lotus-llama")


def write_lotus(root, block_size: int = 4, iterations: int = 3, seed: int = 0,
                **base_overrides) -> Path:
    """A LOTUS model directory ``root/model``: tiny Llama with 3 extra embedding rows
    (start, end, latent = vocab, vocab + 1, vocab + 2) and its latent_config.json."""
    from latentserve.bench.baseline.tiny_models import VOCAB, save_tiny

    vocab = base_overrides.pop("vocab_size", VOCAB)
    out = save_tiny(Path(root) / "model", "llama", seed=seed, vocab_size=vocab + 3,
                    **base_overrides)
    cfg = {"format_version": 1, "family": "lotus", "checkpoint": None,
           "tokens": {"start": vocab, "end": vocab + 1, "latent": vocab + 2},
           "answer_prompt_ids": [], "block_size": block_size, "default_budget": iterations,
           "max_budget": 64, "loop_rule": "same", "lora": None, "prj": None}
    (out / "latent_config.json").write_text(json.dumps(cfg, indent=2))
    return out


def save_loop_tiny(root, kind: str, seed: int = 0, block_size: int = 4,
                   iterations: int = 3) -> Path:
    """Build ``kind`` (one of ``LOOP_KINDS``) under ``root``; returns the model directory
    (PCCoT: converted into ``root/model``; the upstream dirs are ``root/base`` and
    ``root/adapter``). ``pccot-llama`` has ``use_projection``. Raises ValueError for an
    unknown kind."""
    from latentserve.latent.loop_convert import convert_pccot

    root = Path(root)
    if kind == "lotus-llama":
        return write_lotus(root, block_size, iterations, seed)
    if kind in ("pccot-gpt2", "pccot-llama"):
        base = kind.split("-")[1]
        base_dir, adapter = write_upstream_pccot(root, base, block_size, iterations,
                                                 use_projection=base == "llama", seed=seed)
        return convert_pccot(base_dir, adapter, root / "model")
    raise ValueError(f"kind must be one of {LOOP_KINDS}, got {kind!r}")


@lru_cache(maxsize=4)
def load_lotus_reference(model_dir: str, device: str = "cpu",
                         dtype: str = "float32") -> LoopReference:
    """LOTUS from a model directory (plain HF weights + latent_config.json). An optional
    ``prj`` (``{"eps"}``) is rebuilt as ``Sequential(Linear, GELU, Linear, LayerNorm)`` from the
    ``prj.*`` tensors of the directory's ``*.safetensors``. Raises ValueError for a
    ``checkpoint`` file or ``lora`` (weights HF's ``from_pretrained`` would not read)."""
    from safetensors.torch import load_file
    from torch import nn
    from transformers import AutoModelForCausalLM

    cfg = json.loads((Path(model_dir) / "latent_config.json").read_text())
    for field in ("checkpoint", "lora"):
        if cfg.get(field) is not None:
            raise ValueError(f"load_lotus_reference: latent_config.json field {field!r} is not "
                             f"supported (plain HF weights only), got {cfg[field]!r}")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    prj = lambda x: x  # noqa: E731 - replaced below when the checkpoint has a projection
    if cfg.get("prj") is not None:
        d = model.config.hidden_size
        seq = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d),
                            nn.LayerNorm(d, eps=cfg["prj"].get("eps", 1e-5)))
        state = {k.removeprefix("prj."): v for f in sorted(Path(model_dir).glob("*.safetensors"))
                 for k, v in load_file(str(f)).items() if k.startswith("prj.")}
        seq.load_state_dict(state, strict=True)
        prj = seq.to(device, getattr(torch, dtype)).eval()
    t = cfg["tokens"]
    return LoopReference(model, prj, [t["start"]],
                         [t["end"], *cfg.get("answer_prompt_ids", [])], t["latent"],
                         cfg["block_size"], cfg.get("loop_rule", "same"), _eos(model),
                         "lotus")
