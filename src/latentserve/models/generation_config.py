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


def sampling_defaults(model_dir: str | os.PathLike[str], setting: str = "auto") -> dict:
    """The ``SamplingParams`` defaults ``setting`` gives for ``model_dir``. Raises ValueError
    naming ``generation_config`` (bad setting or file) or the file and field."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        path = base_model_dir(model_dir) / GENERATION_CONFIG_FILE
        if not path.is_file():
            return {}
    else:
        path = Path(setting).expanduser() / GENERATION_CONFIG_FILE
        if not path.is_file():
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder holding "
                             f"{GENERATION_CONFIG_FILE}; there is no {path}")
    try:
        raw = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"generation_config: {path} is not valid JSON: {e}") from None
    kind = type(raw).__name__
    raw = raw if isinstance(raw, dict) else None
    if raw is None:
        raise ValueError(f"generation_config: {path} must hold a JSON object, got {kind}")
    out = {field: raw[key] for key, field in SAMPLING_KEYS.items() if raw.get(key) is not None}
    try:
        SamplingParams(**out)
    except ValueError as e:
        raise ValueError(f"generation_config: {path}: {e}") from None
    return out
