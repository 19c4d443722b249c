"""A model's sampling defaults from its ``generation_config.json``, as vLLM's
``--generation-config`` (``ModelConfig.get_diff_sampling_param``, ``vllm/config/model.py``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from latentserve.models.checkpoint import base_model_dir
from latentserve.sampling_params import SamplingParams

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field (vLLM's available_params).
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                 "min_p": "min_p", "repetition_penalty": "repetition_penalty",
                 "max_new_tokens": "max_tokens"}


def generation_config_file(model_dir: str | os.PathLike[str] | None,
                           setting: str = "auto") -> Path | None:
    """The ``generation_config.json`` that ``setting`` names for ``model_dir`` (``auto``: the
    model's, if any; ``vllm``: none). Raises ValueError naming ``generation_config`` for a
    folder without the file."""
    if setting == "vllm":
        return None
    if setting == "auto":
        path = base_model_dir(model_dir) / GENERATION_CONFIG_FILE
        return path if path.is_file() else None
    path = Path(setting).expanduser() / GENERATION_CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding "
                         f"{GENERATION_CONFIG_FILE}; there is no {path}")
    return path


def sampling_defaults(model_dir: str | os.PathLike[str], setting: str = "auto") -> dict:
    """The ``SamplingParams`` defaults ``setting`` gives for ``model_dir``. Raises ValueError
    naming ``generation_config`` (bad setting or file) or the file and field."""
    path = generation_config_file(model_dir, setting)
    if path is None:
        return {}
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"generation_config: {path} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"generation_config: {path} must hold a JSON object, got "
                         f"{type(raw).__name__}")
    out = {field: raw[key] for key, field in SAMPLING_KEYS.items() if raw.get(key) is not None}
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ValueError(f"generation_config: {path}: {e}") from None
    return out
