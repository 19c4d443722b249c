"""Tiny random COCONUT / CODI checkpoints written in the exact upstream forms, then converted
with ``latentserve convert`` (the documented user path; docs/models.md).

Design notes: docs/internals.md, "latentserve.bench.baseline.latent_models".
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from latentserve.bench.baseline.tiny_models import save_tiny
from latentserve.extras import require
from latentserve.latent.convert import convert_coconut, convert_codi

LATENT_KINDS = ("coconut-gpt2", "coconut-llama", "coconut-llama-noprefix", "codi-gpt2",
                "codi-llama")
LORA_TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"],
                "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj",
                          "gate_proj"]}


def resized_base(base_dir: Path, seed: int, rows: int = 0):
    """The base HF model with new random embedding (and untied lm_head) rows: 3, or up to
    ``rows`` when the vocabulary is smaller; and the generator that drew them."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    v = model.config.vocab_size
    model.resize_token_embeddings(max(rows, v) if rows else v + 3, mean_resizing=False)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        emb = model.get_input_embeddings().weight
        emb[v:] = torch.randn(emb.shape[0] - v, emb.shape[1], generator=g) * 0.08
        head = model.get_output_embeddings().weight
        if head.data_ptr() != emb.data_ptr():
            head[v:] = torch.randn(head.shape[0] - v, head.shape[1], generator=g) * 0.08
    return model, g


def write_upstream_coconut(root, base: str = "gpt2", prefix: bool = True, seed: int = 0,
                           **tiny_kw):
    """Write ``root/base`` (tiny ``gpt2`` or untied ``llama``; ``tiny_kw`` to ``save_tiny``)
    and ``root/upstream/checkpoint_7``. Returns ``(base_dir, checkpoint_path)``."""
    root = Path(root)
    base_dir = save_tiny(root / "base", "gpt2" if base == "gpt2" else "llama-untied", seed=seed,
                         **tiny_kw)
    model, _ = resized_base(base_dir, seed)
    sd = {("base_causallm." if prefix else "") + k: v for k, v in model.state_dict().items()}
    (root / "upstream").mkdir(parents=True, exist_ok=True)
    ckpt = root / "upstream" / "checkpoint_7"
    torch.save(sd, ckpt)
    return base_dir, ckpt


def write_upstream_codi(root, base: str = "gpt2", fmt: str = "safetensors", lora_r: int = 8,
                        lora_alpha: float = 16.0, prj_dim: int = 48, layer_norm: bool = True,
                        seed: int = 0, base_dir=None):
    """Write ``root/base`` (tiny ``gpt2`` or tied ``llama``; or use an existing ``base_dir``
    of that architecture) and ``root/upstream/<file>`` (``model.safetensors`` or
    ``pytorch_model.bin``). Returns ``(base_dir, checkpoint_path)``."""
    require("peft", "write_upstream_codi (a CODI test checkpoint)")
    from peft import LoraConfig, get_peft_model

    root = Path(root)
    base_dir = Path(base_dir) if base_dir else save_tiny(root / "base", base, seed=seed)
    model, _ = resized_base(base_dir, seed)
    cfg = LoraConfig(task_type="CAUSAL_LM", r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.1,
                     target_modules=LORA_TARGETS[base], init_lora_weights=True,
                     fan_in_fan_out=base == "gpt2")
    codi = nn.Module()
    codi.codi = get_peft_model(model, cfg)
    d = model.config.hidden_size
    codi.prj = nn.Sequential(nn.Dropout(0.0), nn.Linear(d, prj_dim), nn.GELU(),
                             nn.Linear(prj_dim, d))
    if layer_norm:
        codi.prj.add_module("ln", nn.LayerNorm(d))
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in codi.named_parameters():
            if "lora_B" in name or name.startswith("prj."):
                p.copy_(torch.randn(p.shape, generator=g) * (0.3 if "prj." in name else 0.05))
            if name == "prj.ln.weight":
                p.add_(1.0)
    sd, seen = {}, set()
    for k, v in codi.state_dict().items():
        if fmt == "safetensors" and v.data_ptr() in seen:
            continue  # tied lm_head: safetensors stores shared storage once
        seen.add(v.data_ptr())
        sd[k] = v.contiguous()
    (root / "upstream").mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors":
        from safetensors.torch import save_file

        ckpt = root / "upstream" / "model.safetensors"
        save_file(sd, str(ckpt), metadata={"format": "pt"})
    elif fmt == "bin":
        ckpt = root / "upstream" / "pytorch_model.bin"
        torch.save(sd, ckpt)
    else:
        raise ValueError(f"fmt must be 'safetensors' or 'bin', got {fmt!r}")
    return base_dir, ckpt


def save_latent_tiny(root, kind: str, seed: int = 0, **convert_opts) -> Path:
    """Build ``kind`` (``LATENT_KINDS``) under ``root`` and convert it into ``root/model``
    (returned; ``convert_opts`` to the converter). ValueError for an unknown kind."""
    root = Path(root)
    if kind.startswith("coconut-"):
        base, prefix = kind.split("-")[1], not kind.endswith("-noprefix")
        base_dir, ckpt = write_upstream_coconut(root, base, prefix, seed)
        return convert_coconut(base_dir, ckpt, root / "model", **convert_opts)
    if kind in ("codi-gpt2", "codi-llama"):
        base = kind.split("-")[1]
        base_dir, ckpt = write_upstream_codi(root, base, "safetensors" if base == "gpt2" else "bin",
                                             seed=seed)
        return convert_codi(base_dir, ckpt, root / "model", lora_alpha=16.0, **convert_opts)
    raise ValueError(f"kind must be one of {LATENT_KINDS}, got {kind!r}")
