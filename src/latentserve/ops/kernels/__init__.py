"""Triton kernels of the CUDA fast path, one module per kernel (torch references beside
them in ``latentserve.ops``).

* ``rms_norm``: optional residual add + RMSNorm, one program per row.
* ``rotary``: RoPE applied to q and k in place, one program per token.
* ``rotary_pairs``: Huginn's RoPE (interleaved pairs, fp32) with its ``qk_bias`` add, in place.
* ``rotary_store_kv``: either RoPE on q in place, with the rotated k and the v written into
  the layer's paged KV pool in the same launch (the attention backend then skips its store).
* ``silu_and_mul``: SiLU(gate) * up on a fused ``[T, 2I]`` gate/up projection.
* ``decode_linear``: the weight GEMMs of a decode-sized batch (split-K, SiLU-mul prologue,
  partial sums for the next RMSNorm).
* ``qkv_rope``: the q/k/v projection of a decode-sized batch with RoPE and the KV store in
  its epilogue (one launch for what took the GEMM and ``rotary_store_kv``).
* ``argmax``: row-wise argmax in two passes (greedy sampling's token pick).
* ``decode_inputs``: a decode batch's packed index vectors unpacked into a CUDA graph's
  input buffers (pending ids substituted, KV slots looked up).
* ``embed_inject``: the embedding lookup with latent rows swapped in.
* ``rope_rows``: the RoPE (cos, sin) table's rows at the tokens' positions.
* ``pdl``: programmatic dependent launch, which every kernel above uses on Hopper.

Each kernel rounds where the Hugging Face eager modules round (to the activation dtype
between steps), so bf16 results match the unfused path closely, not only within bf16 noise.
Importing this package imports triton. Set ``TRITON_INTERPRET=1`` before the first import to
run the kernels on CPU tensors (tests).
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
