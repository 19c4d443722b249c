"""Triton kernels of the ``triton`` attention backend, one module per kernel."""

from latentserve.attention.kernels.decode_attention import decode_attention
from latentserve.attention.kernels.extend_attention import extend_attention
from latentserve.attention.kernels.store_kv import store_kv

__all__ = ["decode_attention", "extend_attention", "store_kv"]
