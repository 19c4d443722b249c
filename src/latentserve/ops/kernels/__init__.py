"""Triton kernels of the CUDA fast path, one module per kernel (torch references beside
them in ``latentserve.ops``).

* ``rms_norm``: optional residual add + RMSNorm, one program per row.
* ``rotary``: RoPE applied to q and k in place, one program per token.
* ``silu_and_mul``: SiLU(gate) * up on a fused ``[T, 2I]`` gate/up projection.

Each kernel rounds where the Hugging Face eager modules round (to the activation dtype
between steps), so bf16 results match the unfused path closely, not only within bf16 noise.
Importing this package imports triton. Set ``TRITON_INTERPRET=1`` before the first import to
run the kernels on CPU tensors (tests).
"""

from latentserve.ops.kernels.rms_norm import rms_norm
from latentserve.ops.kernels.rotary import apply_rotary_
from latentserve.ops.kernels.silu_and_mul import silu_and_mul

__all__ = ["apply_rotary_", "rms_norm", "silu_and_mul"]
