"""Turns a ``ScheduledBatch`` into tensors, runs the model once and returns the logits of
the rows that sample."""

from __future__ import annotations

import torch

from latentserve.attention.base import AttentionBackend, BatchLayout
from latentserve.context import ForwardContext, set_context
from latentserve.kvcache.pool import KVPool, PageTable
from latentserve.scheduler.scheduler import ScheduledBatch


class ModelRunner:
    """Runs forwards of ``model`` over the paged ``kv_pool``.

    ``run(batch)`` returns ``(logits [S, vocab] float32, last_hidden [S, hidden])`` for the S
    rows with ``batch.sample`` set (in batch order): the final-normed hidden state of each
    such request's last position, which latent families feed back.
    Positions a request computes inside its latent span take ``req.latent_embeds`` as input.
    ``num_computed_tokens`` counts every token forwarded (prefix-cache tests read it).
    """

    def __init__(self, model, kv_pool: KVPool, table: PageTable, backend: AttentionBackend,
                 device: torch.device):
        self.model = model
        self.kv_pool = kv_pool
        self.table = table
        self.backend = backend
        self.device = device
        self.num_computed_tokens = 0

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor]:
        ids, pos, last = [], [], []
        inj_rows, inj_vecs = [], []
        for req, start, n in zip(batch.reqs, batch.starts, batch.q_lens):
            if req.latent_embeds:  # latent span [lo, hi) of this chunk takes vectors
                lo = max(start, req.latent_start)
                hi = min(start + n, req.latent_start + len(req.latent_embeds))
                for p in range(lo, hi):
                    inj_rows.append(len(ids) + p - start)
                    inj_vecs.append(req.latent_embeds[p - req.latent_start])
            ids.extend(req.ids[start : start + n])
            pos.extend(range(start, start + n))
            last.append(len(ids) - 1)
        dev = self.device
        rows = torch.tensor([r.row for r in batch.reqs], device=dev)
        positions = torch.tensor(pos, device=dev)
        # Slot of each new token: page_table[row, position].
        row_of_token = torch.repeat_interleave(rows, torch.tensor(batch.q_lens, device=dev))
        layout = BatchLayout(
            q_lens=batch.q_lens,
            kv_lens=[s + n for s, n in zip(batch.starts, batch.q_lens)],
            rows=rows,
            out_slots=self.table.table[row_of_token, positions],
        )
        meta = self.backend.prepare(layout, self.table.table)
        set_context(ForwardContext(meta, self.backend, self.kv_pool))
        input_embeds = latent_mask = None
        if inj_rows:
            rows_t = torch.tensor(inj_rows, dtype=torch.long, device=dev)
            vecs = torch.stack(inj_vecs)
            input_embeds = vecs.new_zeros(len(ids), vecs.shape[-1]).index_copy_(0, rows_t, vecs)
            latent_mask = torch.zeros(len(ids), dtype=torch.bool, device=dev)
            latent_mask[rows_t] = True
        try:
            hidden = self.model(torch.tensor(ids, device=dev), positions, input_embeds,
                                latent_mask)
        finally:
            set_context(None)
        self.num_computed_tokens += len(ids)
        sample_rows = [i for i, s in zip(last, batch.sample) if s]
        last_hidden = hidden[torch.tensor(sample_rows, dtype=torch.long, device=dev)]
        return self.model.compute_logits(last_hidden), last_hidden
