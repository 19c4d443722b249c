"""Training: text CoT (``cot.py``), CoLaR (``colar.py``, ``colar_grpo.py``) and the
compression head (``sft.py``, ``dagger.py``, ``grpo.py``). Light: the CLI imports it to build
its parser."""

# The LoRA target modules of a fresh adapter (Llama names), ``--lora-targets``' default.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
