"""Maps a Hugging Face config's ``model_type`` to our model class."""

from __future__ import annotations


def model_class(hf_config):
    """Return the model class for ``hf_config``. Raises ValueError naming the supported types."""
    from latentserve.models.gpt2 import GPT2LMHeadModel
    from latentserve.models.llama import LlamaForCausalLM

    table = {"llama": LlamaForCausalLM, "qwen2": LlamaForCausalLM, "mistral": LlamaForCausalLM,
             "gpt2": GPT2LMHeadModel}
    mt = getattr(hf_config, "model_type", None)
    if mt not in table:
        raise ValueError(f"model_type {mt!r} is not supported; supported: {sorted(table)}")
    return table[mt]
