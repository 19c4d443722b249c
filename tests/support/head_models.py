"""Tiny backbones with a random compression-head bundle inside ("one model, one
directory": ``latent_reasoning_head.safetensors`` next to the weights), for tests and
benchmarks. The bundle is ``latent.bundle.random_bundle``; thinking-span text is given in
its config because the SmolLM2 tokenizer has no ``<think>`` tokens."""

from __future__ import annotations

from pathlib import Path

THINK_OPEN, THINK_CLOSE = " Let me think step by step.", " Answer:"


def save_head_model(root, kind: str = "llama", injection: str = "closed_loop",
                    source_layer: int = 1, latent_dim: int = 16, seed: int = 0,
                    stop_bias: float = 0.0, bundle_name: str | None = None,
                    bundle_format: str = "safetensors", **overrides) -> Path:
    """Write a tiny ``kind`` backbone (3 layers unless overridden; ``save_tiny``) into
    ``root`` with a random bundle (``stop_bias`` shifts the stop logit) and return the
    directory. With ``bundle_name`` the bundle gets that name and ``config.json`` names it
    (key ``latent_reasoning_head``)."""
    import json

    from latentserve.bench.baseline.tiny_models import save_tiny
    from latentserve.latent.bundle import random_bundle, write_bundle
    from latentserve.latent.head import HEAD_BUNDLE_NAME

    d = save_tiny(Path(root), kind, seed=seed, **{"num_hidden_layers": 3, **overrides})
    cfg = json.loads((d / "config.json").read_text())
    hidden = cfg.get("hidden_size") or cfg["n_embd"]
    b = random_bundle(hidden, latent_dim, source_layer=source_layer, seed=seed + 7,
                      stop_bias=stop_bias, injection=injection, think_open=THINK_OPEN,
                      think_close=THINK_CLOSE)
    name = bundle_name or HEAD_BUNDLE_NAME
    if bundle_format == "pt":
        name = name.rsplit(".", 1)[0] + ".pt"
    write_bundle(b, d / name)
    if bundle_name:
        cfg["latent_reasoning_head"] = name
        (d / "config.json").write_text(json.dumps(cfg, indent=2))
    return d
