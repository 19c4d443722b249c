"""Build a model from an HF-style directory (safetensors, else ``pytorch_model*.bin`` with
``weights_only=True``) or a PEFT LoRA adapter directory over one (merged at load)."""

from __future__ import annotations

from pathlib import Path

import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"


def weight_files(model_dir: Path) -> list[Path]:
    """``model_dir``'s weight ``*.safetensors`` (as vLLM's ``filter_duplicate_safetensors_files``);
    ValueError for a bad index, FileNotFoundError for a missing file it names."""
    import json

    index = model_dir / SAFETENSORS_INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map")
        except (json.JSONDecodeError, AttributeError):
            weight_map = None
        if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) for f in weight_map.values()):
            raise ValueError(f"{index}: must be a JSON object whose 'weight_map' maps tensor "
                             "names to file names")
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names {missing[0]}, which is not in {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    others = [f for f in files if not f.name.startswith("consolidated")]
    return others or files


def iter_weights(model_dir: Path):
    """Yield ``(name, tensor)`` from ``model_dir``'s weight files, skipping a CoLaR policy or
    head bundle. Raises FileNotFoundError when there is none."""
    files = weight_files(model_dir)
    if files:
        from safetensors import safe_open

        for f in files:
            if f.name == "latent_policy.safetensors":
                continue  # CoLaR's latent policy next to the weights (latent/colar.py)
            with safe_open(str(f), framework="pt") as sf:
                names = list(sf.keys())
                if any(n.startswith("reasoning_head.") for n in names):
                    continue  # a compression-head bundle next to the weights (latent/bundle.py)
                for name in names:
                    yield name, sf.get_tensor(name)
        return
    bins = sorted(model_dir.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {model_dir}")
    for f in bins:
        yield from torch.load(f, map_location="cpu", weights_only=True).items()


def _read_adapter(model_dir: Path):
    """``models.lora.read_adapter(model_dir)`` for an adapter directory, else None. Raises
    ValueError when the adapter or its base holds a ``latent_config.json`` (not merged)."""
    from latentserve.models.checkpoint import is_adapter_dir

    if not is_adapter_dir(model_dir):
        return None
    from latentserve.models.lora import read_adapter

    adapter = read_adapter(model_dir)
    for d in (model_dir, adapter.base_dir):
        if (d / "latent_config.json").exists():
            raise ValueError(f"{d / 'latent_config.json'}: LoRA adapter directories are "
                             "merged into plain models only")
    return adapter


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str, *,
               latent_head: str | None = None, no_latent_head: bool = False,
               latent_injection: str | None = None, tp=None, fused_ops: bool = False):
    """``(model, hf_config)`` in eval mode on ``device`` (dispatch: docs/internals.md).
    Raises ValueError for an unsupported ``model_type``, a bad latent config or adapter, or a
    model the TP size cannot split."""
    import json

    from transformers import AutoConfig

    from latentserve.models.registry import OWN_CONFIG_TYPES, config_from_dict, model_class

    model_dir = Path(model_dir)
    adapter = _read_adapter(model_dir)
    config_dir = adapter.base_dir if adapter is not None else model_dir
    raw = json.loads((config_dir / "config.json").read_text()) \
        if (config_dir / "config.json").is_file() else {}
    if raw.get("model_type") in OWN_CONFIG_TYPES:
        hf_config = config_from_dict(raw)
    else:
        hf_config = AutoConfig.from_pretrained(config_dir, local_files_only=True)
    latent_cfg = loop_cfg = None
    if adapter is not None:
        from latentserve.models.lora import merge_adapter

        weights = merge_adapter(iter_weights(adapter.base_dir), adapter, hf_config)
    elif (model_dir / "latent_config.json").exists():
        from latentserve.latent.feedback import prepare_latent_weights, read_latent_config
        from latentserve.latent.loop_checkpoint import prepare_loop_weights, read_loop_config

        loop_cfg = read_loop_config(model_dir)
        if loop_cfg is not None:
            weights, hf_config = prepare_loop_weights(model_dir, hf_config, loop_cfg)
        else:
            latent_cfg = read_latent_config(model_dir)
            weights, hf_config = prepare_latent_weights(model_dir, hf_config, latent_cfg)
    else:
        weights = iter_weights(model_dir)
    cls = model_class(hf_config)
    with torch.device("cpu"):
        model = cls(hf_config)
    model.load_weights(weights)
    if tp is not None and tp.size > 1:
        from latentserve.models.parallel import shard_model

        shard_model(model, tp)
    if fused_ops and hasattr(model, "use_fused_ops"):
        model.use_fused_ops()  # on the CPU: the merged weights move to the device once
    own_latents = loop_cfg is not None or latent_cfg is not None \
        or getattr(model, "latent_spec", None) is not None  # recurrent models bring their own
    colar = not no_latent_head and (model_dir / "colar_config.json").is_file()  # CoLaR
    if (own_latents or colar) and latent_head is not None:  # a bundle would do nothing
        raise ValueError(f"--latent-head (latent_head) needs a plain backbone; {model_dir} "
                         "is a latent-reasoning model already (latent_config.json, "
                         "colar_config.json or recurrent depth)")
    model = model.to(device=device, dtype=dtype).eval()
    if loop_cfg is not None:
        from latentserve.latent.loop_checkpoint import attach_loop

        attach_loop(model, model_dir, hf_config, loop_cfg, dtype, device)
    elif latent_cfg is not None:
        from latentserve.latent.feedback import attach_latent

        attach_latent(model, model_dir, hf_config, latent_cfg, dtype, device)
    elif colar:
        from latentserve.latent.colar_head import attach_colar

        attach_colar(model, model_dir, hf_config, device)
    elif not own_latents:
        from latentserve.latent.bundle import attach_head, find_bundle

        bundle = find_bundle(model_dir, latent_head, no_latent_head)
        if bundle is not None:
            attach_head(model, model_dir, hf_config, bundle, device, latent_injection)
    model.requires_grad_(False)
    return model, hf_config
