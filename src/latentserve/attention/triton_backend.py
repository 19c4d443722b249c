"""Triton attention backend: paged KV read through the page table (docs/internals.md)."""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch

from latentserve.attention.base import AttentionBackend, BatchLayout
from latentserve.attention.kernels import decode_attention, extend_attention, store_kv
from latentserve.staging import to_device


@dataclass(slots=True)
class TritonMeta:
    """Per-batch metadata: device ``rows [B] int64``, ``q_start [B + 1] int32``, ``kv_lens
    [B] int32``, ``out_slots [T] int64``, ``page_table``; host ``num_reqs``, ``max_q_len``,
    ``is_decode``."""

    rows: torch.Tensor
    q_start: torch.Tensor
    kv_lens: torch.Tensor
    out_slots: torch.Tensor
    page_table: torch.Tensor
    num_reqs: int
    max_q_len: int
    is_decode: bool


class TritonBackend(AttentionBackend):
    """Attention through Triton kernels over the paged KV pool (page size 1).

    ``num_kv_splits``: the most flash-decoding splits per (request, KV head); ``num_sms``:
    None = the device's; ``decode_block_n`` None: 128 for one split and head_dim <= 64,
    else 64. Shapes as ``AttentionBackend.forward``; fp32 softmax and accumulation.
    """

    fused_kv_store = True

    def __init__(self, num_kv_splits: int = 8, decode_block_n: int | None = None,
                 extend_block_m: int = 64, extend_block_n: int = 64,
                 num_sms: int | None = None):
        for name, val in (("decode_block_n", decode_block_n), ("extend_block_m", extend_block_m),
                          ("extend_block_n", extend_block_n)):
            if val is not None and (val < 16 or val & (val - 1)):
                raise ValueError(f"{name} must be a power of 2 >= 16, got {val}")
        self.num_kv_splits = num_kv_splits
        self.num_sms = num_sms
        self.decode_block_n = decode_block_n
        self.extend_block_m = extend_block_m
        self.extend_block_n = extend_block_n

    def decode_splits(self, batch: int, kv_heads: int, device=None) -> int:
        """Splits per (request, KV head): 1 when the programs cover the SMs three times, else
        the fewest power of 2 (<= ``num_kv_splits``) giving four programs per SM."""
        sms = self.num_sms or _device_sms(device)
        programs = max(batch * kv_heads, 1)
        if programs >= 3 * sms:
            return 1
        want = -(-4 * sms // programs)
        return min(self.num_kv_splits, 1 << (want - 1).bit_length())

    def decode_tile(self, splits: int, head_dim: int) -> int:
        """Keys per decode tile: ``decode_block_n`` when set, else 128 for one split (each
        program walks a whole request) at head_dim <= 64, 64 otherwise."""
        if self.decode_block_n is not None:
            return self.decode_block_n
        return 128 if splits == 1 and head_dim <= 64 else 64

    def prepare(self, layout: BatchLayout, page_table: torch.Tensor) -> TritonMeta:
        """Build the batch's metadata on ``page_table``'s device (one host-to-device copy)."""
        dev, b = page_table.device, len(layout.q_lens)
        # One transfer for both int32 vectors: [q_start (B + 1) | kv_lens (B)].
        packed = to_device([*accumulate(layout.q_lens, initial=0), *layout.kv_lens],
                           torch.int32, dev)
        return TritonMeta(layout.rows.to(device=dev, dtype=torch.int64), packed[:b + 1],
                          packed[b + 1:], layout.out_slots, page_table, b, max(layout.q_lens),
                          all(n == 1 for n in layout.q_lens))

    def forward(self, layer, q, k, v, meta: TritonMeta, kv_pool, scale, prefetch_next=None):
        k_cache, v_cache = kv_pool.k[layer], kv_pool.v[layer]
        if k is not None:
            store_kv(k, v, k_cache, v_cache, meta.out_slots)
        if q.stride(-1) != 1:
            q = q.contiguous()
        if meta.is_decode:
            splits = self.decode_splits(q.shape[0], k_cache.shape[1], q.device)
            return decode_attention(
                q, k_cache, v_cache, meta.page_table, meta.rows, meta.kv_lens, scale,
                num_kv_splits=splits, block_n=self.decode_tile(splits, q.shape[-1]),
                prefetch_next=prefetch_next,
            )
        return extend_attention(
            q, k_cache, v_cache, meta.page_table, meta.rows, meta.q_start, meta.kv_lens,
            meta.max_q_len, scale, block_m=self.extend_block_m, block_n=self.extend_block_n,
        )

    def prefetches(self, meta: TritonMeta, weight: torch.Tensor | None, kv_heads: int) -> bool:
        """True for a one-split decode batch on a device with PDL when all of ``weight`` fits
        ``decode_attention.prefetch_budget`` (the prefetch ends right before the GEMM)."""
        from latentserve.attention.kernels.decode_attention import prefetch_budget
        from latentserve.ops.kernels.pdl import pdl_enabled

        if (weight is None or not meta.is_decode or not weight.is_contiguous()
                or self.decode_splits(meta.num_reqs, kv_heads, weight.device) != 1):
            return False
        return (weight.numel() * weight.element_size() <= prefetch_budget()
                and pdl_enabled(weight.device))


_SMS: dict = {}


def _device_sms(device) -> int:
    """Multiprocessors of a CUDA device (cached); 132 for anything else."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type != "cuda":
        return 132
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    if key not in _SMS:
        _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return _SMS[key]
