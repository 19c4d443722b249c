"""Maps a Hugging Face config's ``model_type`` to our backbone class (the recurrent-depth
models are latent families: ``latent/load.py``)."""

from __future__ import annotations

from latentserve.models.gpt2 import GPT2LMHeadModel
from latentserve.models.llama import LlamaForCausalLM

# model_types served by ``LlamaForCausalLM`` (HF weight names ``model.layers.i.self_attn.*``,
# ``mlp.{gate,up,down}_proj``); LoRA adapter directories are merged into these only.
LLAMA_FAMILY = ("llama", "qwen2", "mistral")
BACKBONES = {**dict.fromkeys(LLAMA_FAMILY, LlamaForCausalLM), "gpt2": GPT2LMHeadModel}


def model_class(hf_config):
    """The ``BACKBONES`` class for ``hf_config``; ValueError naming the supported types."""
    mt = getattr(hf_config, "model_type", None)
    if mt not in BACKBONES:
        raise ValueError(f"model_type {mt!r} is not supported; supported: {sorted(BACKBONES)}")
    return BACKBONES[mt]
