"""Elementwise and normalization ops of the decoder layers, each in two forms.

* ``norm.py``, ``rotary.py``, ``activation.py``: plain torch, with the rounding of Hugging
  Face transformers' eager Llama modules. The CPU path and the unfused CUDA path run these;
  they are also the references the kernels are tested against.
* ``kernels/``: one fused Triton kernel per op for the CUDA fast path (``fused_ops``):
  residual-add + RMSNorm, rotary applied to q and k in place, and SiLU(gate) * up. Importing
  ``kernels`` imports triton; the model files import it only when the fast path is on.
"""
