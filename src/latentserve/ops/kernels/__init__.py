"""Triton kernels of the CUDA fast path, one module per kernel (torch references beside
them in ``latentserve.ops``).

Design notes: docs/internals.md, "latentserve.ops.kernels".
"""

from latentserve.ops.kernels.decode_linear import decode_linear
from latentserve.ops.kernels.qkv_rope import qkv_rope_store_kv
from latentserve.ops.kernels.rms_norm import rms_norm
from latentserve.ops.kernels.rotary import apply_rotary_
from latentserve.ops.kernels.rotary_pairs import apply_rotary_pairs_
from latentserve.ops.kernels.rotary_store_kv import (
    apply_rotary_pairs_store_kv_,
    apply_rotary_store_kv_,
)
from latentserve.ops.kernels.silu_and_mul import silu_and_mul

__all__ = [
    "apply_rotary_",
    "apply_rotary_pairs_",
    "apply_rotary_pairs_store_kv_",
    "apply_rotary_store_kv_",
    "decode_linear",
    "qkv_rope_store_kv",
    "rms_norm",
    "silu_and_mul",
]
