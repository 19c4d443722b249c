"""Maps a Hugging Face config's ``model_type`` to our model class."""

from __future__ import annotations

# model_types transformers has no config class for (their upstream code is remote code): the
# loader builds their config from config.json with these functions instead of AutoConfig.
OWN_CONFIG_TYPES = ("huginn_raven", "ouro")
# model_types served by ``LlamaForCausalLM`` (HF weight names ``model.layers.i.self_attn.*``,
# ``mlp.{gate,up,down}_proj``); LoRA adapter directories are merged into these only.
LLAMA_FAMILY = ("llama", "qwen2", "mistral")


def config_from_dict(d: dict):
    """A ``PretrainedConfig`` for a model_type in ``OWN_CONFIG_TYPES`` from its config.json."""
    if d.get("model_type") == "huginn_raven":
        from latentserve.models.huginn import huginn_config

        return huginn_config(d)
    from latentserve.models.ouro import ouro_config

    return ouro_config(d)


def model_class(hf_config):
    """Return the model class for ``hf_config``. Raises ValueError naming the supported types."""
    from latentserve.models.gpt2 import GPT2LMHeadModel
    from latentserve.models.huginn import RavenForCausalLM
    from latentserve.models.llama import LlamaForCausalLM
    from latentserve.models.ouro import OuroForCausalLM

    table = {**dict.fromkeys(LLAMA_FAMILY, LlamaForCausalLM), "gpt2": GPT2LMHeadModel,
             "huginn_raven": RavenForCausalLM, "ouro": OuroForCausalLM}
    mt = getattr(hf_config, "model_type", None)
    if mt not in table:
        raise ValueError(f"model_type {mt!r} is not supported; supported: {sorted(table)}")
    return table[mt]
