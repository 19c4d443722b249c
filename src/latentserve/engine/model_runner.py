"""Turns a ``ScheduledBatch`` into tensors, runs the model once (eagerly, or by replaying a
captured CUDA graph for decode batches) and returns the logits of the rows that sample."""

from __future__ import annotations

import torch

from latentserve.attention.base import AttentionBackend, BatchLayout
from latentserve.context import ForwardContext, set_context
from latentserve.kvcache.pool import KVPool, PageTable
from latentserve.latent.recurrent import RecurrentBatch
from latentserve.scheduler.scheduler import ScheduledBatch


class ModelRunner:
    """Runs forwards of ``model`` over the paged ``kv_pool``.

    ``run(batch)`` returns ``(logits [S, vocab] float32, last_hidden [S, hidden])`` for the S
    rows with ``batch.sample`` set (in batch order): the final-normed hidden state of each
    such request's last position, which latent families feed back.
    Positions a request computes inside its latent span take ``req.latent_embeds`` as input.
    ``num_computed_tokens`` counts every token forwarded (prefix-cache tests read it);
    ``num_graph_steps`` the decode steps replayed from CUDA graphs. With
    ``set_capture(layer)``, ``last_captured`` holds ``[S, hidden]``: the residual stream after
    ``layer`` decoder layers at each sampling row's last position (compression heads read it).
    ``last_hidden_all`` is the last forward's final-normed hidden at every position
    (``[num_tokens, hidden]``, batch order; looped blocks read it).
    For a recurrent-depth model each forward also gets a ``RecurrentBatch`` (per-row depth
    and exit rule, ``ForwardContext.recurrent``) and each token's depth
    (``ForwardContext.depths``); sampling rows' iteration counts go to their requests.
    """

    def __init__(self, model, kv_pool: KVPool, table: PageTable, backend: AttentionBackend,
                 device: torch.device):
        self.model = model
        self.kv_pool = kv_pool
        self.table = table
        self.backend = backend
        self.device = device
        self.graphs = None  # a CudaGraphRunner once capture_graphs() ran
        self.capture_layer = -1
        self.last_captured: torch.Tensor | None = None
        self.last_hidden_all: torch.Tensor | None = None
        self.num_computed_tokens = 0
        self.num_graph_steps = 0
        spec = getattr(model, "latent_spec", None)
        self.recurrent = spec is not None and spec.kind == "recurrent"  # per-token depth

    def set_capture(self, layer: int) -> None:
        """Capture the residual stream after ``layer`` decoder layers (call before
        ``capture_graphs``, which bakes it into the graphs); -1 turns capture off."""
        self.capture_layer = layer

    def capture_graphs(self, max_bs: int, hidden_size: int, dtype: torch.dtype) -> None:
        """Capture decode graphs for batch sizes up to ``max_bs`` (CUDA + Triton only)."""
        from latentserve.engine.cuda_graph import CudaGraphRunner

        self.graphs = CudaGraphRunner(self.model, self.backend, self.kv_pool, self.table,
                                      max_bs, hidden_size, dtype, self.capture_layer)

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
        self.num_computed_tokens += len(ids)
        dev = self.device
        rows_l = [r.row for r in batch.reqs]
        kv_lens = [s + n for s, n in zip(batch.starts, batch.q_lens)]
        # One host-to-device copy for every index vector of the batch.
        packed = torch.tensor([ids, pos], dtype=torch.int64).to(dev, non_blocking=True)
        input_ids, positions = packed[0], packed[1]
        rows = torch.tensor(rows_l, dtype=torch.int64).to(dev, non_blocking=True)
        row_of_token = torch.repeat_interleave(rows, torch.tensor(batch.q_lens, device=dev))
        out_slots = self.table.table[row_of_token, positions]  # slot = table[row, position]
        input_embeds = latent_mask = None
        if inj_rows:
            rows_t = torch.tensor(inj_rows, dtype=torch.long, device=dev)
            vecs = torch.stack(inj_vecs)
            input_embeds = vecs.new_zeros(len(ids), vecs.shape[-1]).index_copy_(0, rows_t, vecs)
            latent_mask = torch.zeros(len(ids), dtype=torch.bool, device=dev)
            latent_mask[rows_t] = True
        layout = BatchLayout(batch.q_lens, kv_lens, rows, out_slots)
        rec = RecurrentBatch.from_batch(batch, layout, self.table.table) if self.recurrent \
            else None
        decode = len(ids) == len(batch.reqs)
        if (self.graphs is not None and decode and len(ids) <= self.graphs.max_bs
                and (rec is None or self.graphs.can_replay(rec))):
            self.num_graph_steps += 1
            kv = torch.tensor(kv_lens, dtype=torch.int32).to(dev, non_blocking=True)
            logits, hidden = self.graphs.replay(input_ids, positions, rows, kv, out_slots,
                                                input_embeds, latent_mask, rec)
            if rec is not None:
                rec.iters_used = list(rec.row_depths)
                rec.record(batch)
            captured = self.graphs.capture_buf[: len(ids)] if self.capture_layer >= 0 else None
            self.last_hidden_all = hidden  # one token per row: every position of the batch
            keep = [i for i, s in enumerate(batch.sample) if s]
            if len(keep) < len(ids):  # a 1-token prefill chunk that does not end its prompt
                idx = torch.tensor(keep, dtype=torch.long, device=dev)
                logits, hidden = logits[idx], hidden[idx]
                captured = None if captured is None else captured[idx]
            self.last_captured = captured
            return logits, hidden
        meta = self.backend.prepare(layout, self.table.table)
        capture_buf = None
        if self.capture_layer >= 0:
            capture_buf = torch.empty(len(ids), self.model.config.hidden_size,
                                      dtype=self.kv_pool.k[0].dtype, device=dev)
        set_context(ForwardContext(meta, self.backend, self.kv_pool, self.capture_layer,
                                   capture_buf, None if rec is None else rec.token_depths(dev),
                                   rec))
        try:
            hidden = self.model(input_ids, positions, input_embeds, latent_mask)
        finally:
            set_context(None)
        if rec is not None:
            rec.record(batch)
        self.last_hidden_all = hidden
        sample_rows = [i for i, s in zip(last, batch.sample) if s]
        idx = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        if capture_buf is not None:
            self.last_captured = capture_buf[idx]
        last_hidden = hidden[idx]
        return self.model.compute_logits(last_hidden), last_hidden
