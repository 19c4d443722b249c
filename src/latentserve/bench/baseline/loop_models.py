"""Tiny random PCCoT checkpoints in the upstream PEFT form, for tests and benchmarks (LOTUS:
``tests/support/loop_models.py``).

Design notes: docs/internals.md, "latentserve.bench.baseline.loop_models".
"""

from __future__ import annotations

import json
from pathlib import Path

from latentserve.bench.baseline.latent_models import LORA_TARGETS, resized_base
from latentserve.bench.baseline.tiny_models import save_tiny
from latentserve.extras import require
from latentserve.models.checkpoint import load_tokenizer

PCCOT_TOKENS = ("<pcot.bot>", "<pcot.eot>", "<pcot.latent>")
EMBEDDING_FORMS = ("trainable_tokens", "modules_to_save", "resized")


def write_upstream_pccot(root, base: str = "gpt2", block_size: int = 4, iterations: int = 3,
                         use_projection: bool = False, lora_r: int = 8,
                         lora_alpha: float = 16.0, seed: int = 0, base_dir=None,
                         embedding: str = "trainable_tokens", train_steps: int = 3,
                         **base_overrides):
    """Write ``root/base`` (a ``save_tiny`` ``gpt2``/``llama``, or ``base_dir``) and
    ``root/adapter`` (upstream PEFT form); returns ``(base_dir, adapter_dir)``. ``embedding``:
    ``trainable_tokens`` (upstream ``run_ccot.py``), ``modules_to_save`` or ``resized``
    (frozen). ``train_steps`` AdamW steps of next-token loss move every trained tensor.
    Raises ValueError for an unknown ``embedding``, ModuleNotFoundError without peft."""
    require("peft", "write_upstream_pccot (a PCCoT test checkpoint)")
    import torch
    from peft import LoraConfig, get_peft_model
    from torch import nn

    if embedding not in EMBEDDING_FORMS:
        raise ValueError(f"embedding must be one of {EMBEDDING_FORMS}, got {embedding!r}")
    root = Path(root)
    base_dir = Path(base_dir) if base_dir else save_tiny(root / "base", base, seed=seed,
                                                          **base_overrides)
    tok = load_tokenizer(base_dir)
    if tok.pad_token is None:
        tok.add_special_tokens({"pad_token": "[PAD]"})
    tok.add_special_tokens({"additional_special_tokens": list(PCCOT_TOKENS)})
    bot, eot, latent = tok.convert_tokens_to_ids(list(PCCOT_TOKENS))
    model, g = resized_base(base_dir, seed, len(tok))
    rows = model.config.vocab_size
    d = model.config.hidden_size
    if use_projection:
        model.prj = nn.Sequential(nn.Linear(d, d), nn.GELU(), nn.Linear(d, d), nn.LayerNorm(d))
    embed_name = "wte" if base == "gpt2" else "embed_tokens"
    special = list(dict.fromkeys([bot, eot, latent, tok.pad_token_id, tok.eos_token_id]))
    saved = ["prj"] if use_projection else []
    if embedding == "modules_to_save":
        saved.append(embed_name)
    cfg = LoraConfig(task_type="CAUSAL_LM", r=lora_r, lora_alpha=lora_alpha, lora_dropout=0.1,
                     target_modules=LORA_TARGETS[base], fan_in_fan_out=base == "gpt2",
                     modules_to_save=saved or None,
                     trainable_token_indices={embed_name: special}
                     if embedding == "trainable_tokens" else None)
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
            elif "prj.modules_to_save" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3 + (1.0 if name.endswith(
                    "3.weight") else 0.0))
    _train(peft_model, rows, special, train_steps, g)
    adapter = root / "adapter"
    # "auto" (what upstream's Trainer.save_model uses) saves the resized embedding
    peft_model.save_pretrained(str(adapter), save_embedding_layers=True
                               if embedding == "resized" else "auto")
    tok.save_pretrained(str(adapter))
    base_cfg = json.loads((base_dir / "config.json").read_text())
    (adapter / "config.json").write_text(json.dumps({
        **base_cfg, "model_type": f"pccot-{base}", "vocab_size": rows,
        "num_iterations": iterations, "use_projection": use_projection, "loss_alpha": 1.0,
        "loss_beta": 1.0, "loss_gamma": 1.0, "use_layerwise_std": True}, indent=2))
    (adapter / "pccot_args.json").write_text(json.dumps({
        "bot_token_id": bot, "eot_token_id": eot, "latent_token_id": latent,
        "label_pad_token_id": -100, "answer_prompt": "The answer is:",
        "num_latent_tokens": block_size, "use_peft": True, "lora_r": lora_r,
        "lora_alpha": lora_alpha, "lora_dropout": 0.1,
        "lora_target_modules": "-".join(LORA_TARGETS[base]),
        "lora_modules_to_save": "-".join(saved)}, indent=4))
    return base_dir, adapter


def _train(peft_model, rows: int, special: list[int], steps: int, g) -> None:
    """``steps`` AdamW steps of next-token loss on 2 random sequences of 12 ids (3 of them
    the special tokens), dropout on; leaves the model in eval mode."""
    import torch

    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    peft_model.train()
    with torch.random.fork_rng():
        torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))  # dropout
        for _ in range(steps):
            ids = torch.randint(0, rows, (2, 12), generator=g)
            ids[:, 3:6] = torch.tensor(special[:3])
            peft_model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    peft_model.eval()
