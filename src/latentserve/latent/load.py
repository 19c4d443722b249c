"""Load a served model directory of any family: the one place that names each latent family's
checkpoint (dispatch: docs/internals.md). A plain backbone or LoRA adapter loads through
``models.loader``; this adds the recurrent-depth models, the ``latent_config.json``
checkpoints (loop, feedback) and the heads attached to a backbone (CoLaR, bundles)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from latentserve.latent import feedback, loop_checkpoint
from latentserve.latent.bundle import attach_head, find_bundle
from latentserve.latent.colar_head import attach_colar
from latentserve.latent.huginn import RavenForCausalLM, huginn_config
from latentserve.latent.ouro import OuroForCausalLM, ouro_config
from latentserve.models import loader
from latentserve.models.checkpoint import is_adapter_dir
from latentserve.models.registry import model_class

# Recurrent-depth model_types: (config from the config.json dict, model class). transformers
# has no config class for them (their upstream code is remote code).
RECURRENT = {"huginn_raven": (huginn_config, RavenForCausalLM),
             "ouro": (ouro_config, OuroForCausalLM)}


def _model_type(model_dir: Path) -> str | None:
    path = model_dir / "config.json"
    return json.loads(path.read_text()).get("model_type") if path.is_file() else None


def _load_own_latents(model_dir: Path, dtype: torch.dtype, device: str, tp, fused_ops: bool):
    """``(model, hf_config)`` of a recurrent-depth model or a ``latent_config.json``
    checkpoint (loop or feedback), its latent parts attached."""
    recurrent = RECURRENT.get(_model_type(model_dir))
    if recurrent is not None:
        config_of, cls = recurrent
        hf_config = config_of(json.loads((model_dir / "config.json").read_text()))
        model = loader.build_model(cls, hf_config, loader.iter_weights(model_dir), dtype,
                                   device, tp=tp, fused_ops=fused_ops)
        return model, hf_config
    hf_config = loader.read_config(model_dir)
    cfg = feedback.read_config_json(model_dir)
    if isinstance(cfg, dict) and cfg.get("family") in loop_checkpoint.LOOP_FAMILIES:
        cfg = loop_checkpoint.validate_loop_config(cfg, model_dir)
        prepare, attach = loop_checkpoint.prepare_loop_weights, loop_checkpoint.attach_loop
    else:
        cfg = feedback.validate_latent_config(cfg, model_dir)
        prepare, attach = feedback.prepare_latent_weights, feedback.attach_latent
    weights, hf_config = prepare(model_dir, hf_config, cfg)
    model = loader.build_model(model_class(hf_config), hf_config, weights, dtype, device,
                               tp=tp, fused_ops=fused_ops)
    attach(model, model_dir, hf_config, cfg, dtype, device)
    return model, hf_config


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str, *,
               latent_head: str | None = None, no_latent_head: bool = False,
               latent_injection: str | None = None, tp=None, fused_ops: bool = False):
    """``(model, hf_config)`` in eval mode on ``device``, no gradients, its latent parts
    attached: a recurrent-depth model (Huginn, Ouro), a ``latent_config.json`` checkpoint, or
    a backbone / LoRA adapter with its CoLaR head (``colar_config.json``, unless
    ``no_latent_head``) or compression-head bundle (``latent_head`` overrides the
    directory's). Raises ValueError for an unsupported ``model_type``, a bad latent config or
    adapter, ``latent_head`` on a latent-reasoning model, or a model the TP size cannot
    split."""
    model_dir = Path(model_dir)
    adapter = is_adapter_dir(model_dir)  # plain bases only (models.loader.read_adapter)
    own_latents = not adapter and ((model_dir / "latent_config.json").exists()
                                   or _model_type(model_dir) in RECURRENT)
    colar = not no_latent_head and (model_dir / "colar_config.json").is_file()
    if (own_latents or colar) and latent_head is not None:  # a bundle would do nothing
        raise ValueError(f"--latent-head (latent_head) needs a plain backbone; {model_dir} "
                         "is a latent-reasoning model already (latent_config.json, "
                         "colar_config.json or recurrent depth)")
    if own_latents:
        model, hf_config = _load_own_latents(model_dir, dtype, device, tp, fused_ops)
    else:
        model, hf_config = loader.load_model(model_dir, dtype, device, tp=tp,
                                             fused_ops=fused_ops)
        if colar:
            attach_colar(model, model_dir, hf_config, device)
        else:
            bundle = find_bundle(model_dir, latent_head, no_latent_head)
            if bundle is not None:
                attach_head(model, model_dir, hf_config, bundle, device, latent_injection)
    model.requires_grad_(False)
    return model, hf_config
