"""The attention backend interface: prepare metadata once per batch, then run attention
for every layer. Backends: ``torch`` (pages gathered, SDPA; CPU and CUDA; the reference) and
``triton`` (paged Triton kernels; CUDA, or CPU under ``TRITON_INTERPRET=1``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class BatchLayout:
    """Where a batch's tokens sit, one request after another in ``T = sum(q_lens)``:
    ``q_lens[b]`` new tokens, ``kv_lens[b]`` KV after this step, ``rows [B] int64`` page-table
    rows, ``out_slots [T] int64`` KV slots written; all on the model's device."""

    q_lens: list[int]
    kv_lens: list[int]
    rows: torch.Tensor
    out_slots: torch.Tensor


class AttentionBackend:
    """``prepare`` builds per-batch metadata from a ``BatchLayout``; ``forward`` stores one layer's
    new K/V into the pool and returns the attention output of every new token. ``fused_kv_store``:
    the caller may store K/V itself (``apply_rotary_store_kv_``) and pass ``k = v = None``."""

    fused_kv_store: bool = False
    supports_key_mask: bool = False  # implements ``mask_keys``

    def mask_keys(self, meta, slot_ok: torch.Tensor, rows: torch.Tensor | None = None):
        """``meta`` also masking keys whose ``slot_ok[slot]`` (``[num_slots + 1] bool``) is
        False, in ``rows`` (``[B] bool``; None = all); each query keeps a key.
        NotImplementedError where ``supports_key_mask`` is False."""
        raise NotImplementedError(f"{type(self).__name__} cannot mask keys per slot")

    def prepare(self, layout: BatchLayout, page_table: torch.Tensor):
        """Return backend-specific metadata for the batch (reused by every layer)."""
        raise NotImplementedError

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta, kv_pool, scale: float,
                prefetch_next: torch.Tensor | None = None) -> torch.Tensor:
        """Attention for one layer: q ``[T, num_heads, head_dim]``, k/v ``[T, num_kv_heads,
        head_dim]`` or None (already stored, ``fused_kv_store``) -> ``[T, num_heads,
        head_dim]`` in q's dtype. ``prefetch_next``: the weight read next, an L2 hint only."""
        raise NotImplementedError

    def prefetches(self, meta, weight: torch.Tensor | None, kv_heads: int) -> bool:
        """Whether ``forward(..., prefetch_next=weight)`` brings all of ``weight`` into L2
        before the caller's next kernel; the base class never prefetches."""
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
