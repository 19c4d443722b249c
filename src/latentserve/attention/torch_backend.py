"""Reference attention backend (CPU and CUDA): each request's pages gathered into a padded batch
for ``scaled_dot_product_attention``; every other backend is tested against it."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from latentserve.attention.base import AttentionBackend, BatchLayout
from latentserve.staging import to_device


@dataclass(slots=True)
class TorchMeta:
    """``kv_index: [B, Kmax] int64`` slot ids (stale past kv_len; masked);
    ``mask: [B, 1, Qmax, Kmax] bool`` (True = attend); ``flat_idx: [T] int64`` position of
    each token in the padded ``[B * Qmax]`` query layout; ``out_slots: [T] int64``."""

    kv_index: torch.Tensor
    mask: torch.Tensor
    flat_idx: torch.Tensor
    out_slots: torch.Tensor


class TorchBackend(AttentionBackend):
    supports_key_mask = True

    def mask_keys(self, meta: TorchMeta, slot_ok, rows=None) -> TorchMeta:
        ok = slot_ok[meta.kv_index]  # [B, Kmax]
        if rows is not None:
            ok = ok | ~rows[:, None]
        mask = meta.mask & ok[:, None, None, :]
        # Padded query rows attend key 0 only; keep them off all-False rows (SDPA NaN).
        mask = torch.where(mask.any(-1, keepdim=True), mask, meta.mask)
        return replace(meta, mask=mask)

    def prepare(self, layout: BatchLayout, page_table: torch.Tensor) -> TorchMeta:
        dev = page_table.device
        q_max, k_max = max(layout.q_lens), max(layout.kv_lens)
        q = to_device(layout.q_lens, torch.int64, dev)
        kv = to_device(layout.kv_lens, torch.int64, dev)
        i = torch.arange(q_max, device=dev)[None, :, None]
        j = torch.arange(k_max, device=dev)[None, None, :]
        start = (kv - q)[:, None, None]
        valid_q = i < q[:, None, None]
        # Query i of request b sits at position start+i and sees keys 0..start+i.
        # NOTE: padded query rows attend to key 0 only, so SDPA never sees an all-False row.
        mask = (valid_q & (j <= start + i)) | (~valid_q & (j == 0))
        flat_idx = valid_q.flatten().nonzero()[:, 0]  # request-major, as the tokens are
        return TorchMeta(page_table[layout.rows, :k_max], mask[:, None], flat_idx,
                         layout.out_slots)

    def forward(self, layer, q, k, v, meta: TorchMeta, kv_pool, scale, prefetch_next=None):
        if k is not None:  # None: the caller stored them (the contract allows; unused here)
            kv_pool.store(layer, meta.out_slots, k, v)
        n_heads, d = q.shape[1], q.shape[2]
        b, _, q_max, _ = meta.mask.shape
        if q_max == 1:
            qp = q[:, None]  # decode: T == B, already in request order
        else:
            qp = q.new_zeros(b * q_max, n_heads, d)
            qp[meta.flat_idx] = q
            qp = qp.view(b, q_max, n_heads, d)
        flat = meta.kv_index.reshape(-1)  # index_select is far faster than advanced indexing
        shape = (*meta.kv_index.shape, *kv_pool.k[layer].shape[1:])
        keys = kv_pool.k[layer].index_select(0, flat).view(shape).to(q.dtype)  # [B,Kmax,Hkv,D]
        vals = kv_pool.v[layer].index_select(0, flat).view(shape).to(q.dtype)
        out = F.scaled_dot_product_attention(
            qp.transpose(1, 2), keys.transpose(1, 2), vals.transpose(1, 2),
            attn_mask=meta.mask, scale=scale, enable_gqa=keys.shape[2] != n_heads,
        )
        out = out.transpose(1, 2)  # [B, Qmax, H, D]
        if q_max == 1:
            return out[:, 0]
        return out.reshape(b * q_max, n_heads, d)[meta.flat_idx]
