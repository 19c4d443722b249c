"""Build a backbone from an HF-style directory (safetensors, else ``pytorch_model*.bin`` with
``weights_only=True``) or a PEFT LoRA adapter directory over one (merged at load); the latent
families build on these in ``latent/load.py``."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from latentserve.models import lora
from latentserve.models.checkpoint import is_adapter_dir
from latentserve.models.parallel import shard_model
from latentserve.models.registry import model_class

SAFETENSORS_INDEX = "model.safetensors.index.json"


def weight_files(model_dir: Path) -> list[Path]:
    """``model_dir``'s weight ``*.safetensors`` (as vLLM's ``filter_duplicate_safetensors_files``);
    ValueError for a bad index, FileNotFoundError for a missing file it names."""
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


def read_adapter(model_dir: Path):
    """``models.lora.read_adapter(model_dir)`` for an adapter directory, else None. Raises
    ValueError when the adapter or its base holds a ``latent_config.json`` or the base is not
    of a model_type adapters merge into."""
    if not is_adapter_dir(model_dir):
        return None
    adapter = lora.read_adapter(model_dir)
    for d in (model_dir, adapter.base_dir):
        if (d / "latent_config.json").exists():
            raise ValueError(f"{d / 'latent_config.json'}: LoRA adapter directories are "
                             "merged into plain models only")
    config = adapter.base_dir / "config.json"  # before transformers reads it (Huginn, Ouro)
    if config.is_file():
        lora.check_base_type(adapter, json.loads(config.read_text()).get("model_type"))
    return adapter


def read_config(config_dir: Path):
    """``config_dir``'s ``config.json`` as a transformers ``PretrainedConfig``."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(config_dir, local_files_only=True)


def build_model(cls, hf_config, weights, dtype: torch.dtype, device: str, *, tp=None,
                fused_ops: bool = False):
    """``cls(hf_config)`` built on the CPU, ``weights`` (``(name, tensor)`` pairs) loaded,
    sharded over ``tp`` when its size is above 1, moved to ``device`` / ``dtype``, eval mode.
    Raises ValueError for a model the TP size cannot split."""
    with torch.device("cpu"):
        model = cls(hf_config)
    model.load_weights(weights)
    if tp is not None and tp.size > 1:
        shard_model(model, tp)
    if fused_ops and hasattr(model, "use_fused_ops"):
        model.use_fused_ops()  # on the CPU: the merged weights move to the device once
    return model.to(device=device, dtype=dtype).eval()


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str, *, tp=None,
               fused_ops: bool = False):
    """``(model, hf_config)`` of a backbone directory or a LoRA adapter over one (merged), in
    eval mode on ``device``, no gradients; a latent family's directory loads through
    ``latent.load.load_model``. Raises ValueError for an unsupported ``model_type``, a bad
    adapter, or a model the TP size cannot split."""
    model_dir = Path(model_dir)
    adapter = read_adapter(model_dir)
    hf_config = read_config(adapter.base_dir if adapter is not None else model_dir)
    if adapter is not None:
        weights = lora.merge_adapter(iter_weights(adapter.base_dir), adapter, hf_config)
    else:
        weights = iter_weights(model_dir)
    model = build_model(model_class(hf_config), hf_config, weights, dtype, device, tp=tp,
                        fused_ops=fused_ops)
    model.requires_grad_(False)
    return model, hf_config
