"""The attention backend interface: prepare metadata once per batch, then run attention
for every layer. Backends: ``torch`` (pages gathered, SDPA; CPU and CUDA; the reference) and
``triton`` (paged Triton kernels; CUDA, or CPU under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class BatchLayout:
    """Where a batch's tokens sit, as the scheduler hands it to the backend.

    Requests are laid out one after another in the flat token dimension ``T = sum(q_lens)``.
    ``q_lens[b]``: tokens computed for request b this step (1 for decode, >1 for extend).
    ``kv_lens[b]``: tokens in request b's KV after this step (cached prefix + new tokens).
    ``rows``: ``[B] int64`` page-table rows. ``out_slots``: ``[T] int64`` KV slots the new
    tokens write to. All tensors live on the model's device.
    """

    q_lens: list[int]
    kv_lens: list[int]
    rows: torch.Tensor
    out_slots: torch.Tensor

    @property
    def num_reqs(self) -> int:
        return len(self.q_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.out_slots.numel())


class AttentionBackend:
    """Five-method contract: ``prepare`` builds per-batch metadata from a ``BatchLayout``;
    ``forward`` stores the new K/V of one layer into the KV pool and returns the attention
    output for every new token.

    ``fused_kv_store``: True when the caller may store the new K/V itself (the fast path's
    RoPE kernel, ``ops.kernels.apply_rotary_store_kv_``, writes them to
    ``kv_pool.k[layer][meta.out_slots]`` in its own launch) and call ``forward`` with
    ``k = v = None``. Such a backend reads the new tokens' K/V from the pool only.
    """

    fused_kv_store: bool = False
    supports_key_mask: bool = False  # implements ``mask_keys``

    def mask_keys(self, meta, slot_ok: torch.Tensor, rows: torch.Tensor | None = None):
        """``meta`` whose rows also mask every key whose slot has ``slot_ok[slot]`` False.

        slot_ok: ``[num_slots + 1] bool`` per KV slot; rows: ``[B] bool``, the rows of
        ``meta`` the mask applies to (None = all). A query must keep at least one key (its
        own, in practice). Raises NotImplementedError where ``supports_key_mask`` is False.
        """
        raise NotImplementedError(f"{type(self).__name__} cannot mask keys per slot")

    def prepare(self, layout: BatchLayout, page_table: torch.Tensor):
        """Return backend-specific metadata for the batch (reused by every layer)."""
        raise NotImplementedError

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta, kv_pool, scale: float,
                prefetch_next: torch.Tensor | None = None) -> torch.Tensor:
        """Attention for one layer.

        Args:
            q: ``[T, num_heads, head_dim]``; k, v: ``[T, num_kv_heads, head_dim]`` (new tokens),
                or both None when already in the pool at ``meta.out_slots`` (only where
                ``fused_kv_store``).
            meta: from ``prepare``; kv_pool: a ``KVPool``; scale: softmax scale.
            prefetch_next: a hint, the weight the caller reads next (the o_proj); a backend
                may ask L2 for it. Results never depend on it.
        Returns:
            ``[T, num_heads, head_dim]`` in q's dtype.
        """
        raise NotImplementedError

    def prefetches(self, meta, weight: torch.Tensor | None, kv_heads: int) -> bool:
        """Whether ``forward(..., prefetch_next=weight)`` on a batch with ``meta`` and a pool
        of ``kv_heads`` KV heads brings all of ``weight`` into L2 right before the caller's
        next kernel (which may then tile its GEMM for an L2-resident weight). The base
        class never prefetches."""
        return False


def make_backend(name: str, num_kv_splits: int = 8) -> AttentionBackend:
    """``"torch"`` (the reference; CPU and CUDA) or ``"triton"`` (CUDA; imports triton lazily;
    ``num_kv_splits``: its decode kernel's flash-decoding splits). Raises ValueError for
    unknown names."""
    if name == "torch":
        from latentserve.attention.torch_backend import TorchBackend

        return TorchBackend()
    if name == "triton":
        from latentserve.attention.triton_backend import TritonBackend

        return TritonBackend(num_kv_splits=num_kv_splits)
    raise ValueError(f"attention_backend must be one of ('torch', 'triton'), got {name!r}")
