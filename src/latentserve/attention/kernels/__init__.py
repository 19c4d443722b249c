"""Triton kernels of the ``triton`` attention backend, one module per kernel.

* ``store_kv``: scatter the new tokens' K/V into the paged KV pool.
* ``decode_attention``: split-K paged decode attention (flash-decoding), two stages.
* ``extend_attention``: causal extend/prefill attention over a cached prefix (FlashAttention-2
  style tiling with an online softmax), keys read through the page table.

Importing this package imports triton. Set ``TRITON_INTERPRET=1`` before the first import to
run the kernels on CPU tensors (tests); the choice is fixed when the kernels are decorated.
"""

from latentserve.attention.kernels.decode_attention import decode_attention
from latentserve.attention.kernels.extend_attention import extend_attention
from latentserve.attention.kernels.store_kv import store_kv

__all__ = ["decode_attention", "extend_attention", "store_kv"]
