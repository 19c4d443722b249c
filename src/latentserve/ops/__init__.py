"""Decoder-layer ops in plain torch with transformers' eager Llama rounding (``norm``,
``rotary``, ``activation``: the CPU and unfused CUDA path, and the references of the fused
Triton kernels in ``kernels``, whose import imports triton)."""
