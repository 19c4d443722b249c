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
    After each run, ``prompt_hidden`` lists ``(req, start, hidden [q_len, hidden])`` for the
    requests with ``params.prompt_logprobs`` set whose chunk holds prompt positions
    ``start ..`` (such batches run eagerly; empty for every other batch).
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
        # (latent_input [S, H] float32, stop_prob [S] or None) of the sampling rows when a
        # graph replay already ran the compression head; None after an eager forward.
        self.last_head_out: tuple | None = None
        self.num_computed_tokens = 0
        self.num_graph_steps = 0
        self.prompt_hidden: list = []
        spec = getattr(model, "latent_spec", None)
        self.recurrent = spec is not None and spec.kind == "recurrent"  # per-token depth

    def set_capture(self, layer: int) -> None:
        """Capture the residual stream after ``layer`` decoder layers (call before
        ``capture_graphs``, which bakes it into the graphs); -1 turns capture off."""
        self.capture_layer = layer

    def release_graphs(self) -> None:
        """Drop the captured decode graphs (later decode steps run eagerly) and wait for the
        device. Tensor parallelism calls it before leaving the process group: graphs that
        captured NCCL collectives keep the communicator busy."""
        self.graphs = None
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)

    def capture_graphs(self, max_bs: int, hidden_size: int, dtype: torch.dtype) -> None:
        """Capture decode graphs for batch sizes up to ``max_bs`` (CUDA + Triton only)."""
        from latentserve.engine.cuda_graph import CudaGraphRunner

        self.graphs = CudaGraphRunner(self.model, self.backend, self.kv_pool, self.table,
                                      max_bs, hidden_size, dtype, self.capture_layer)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor]:
        ids, pos, last, row_tok = [], [], [], []
        inj_rows, inj_vecs = [], []
        for req, start, n in zip(batch.reqs, batch.starts, batch.q_lens):
            if req.latent_embeds:  # latent span [lo, hi) of this chunk takes vectors
                lo = max(start, req.latent_start)
                hi = min(start + n, req.latent_start + len(req.latent_embeds))
                for p in range(lo, hi):
                    inj_rows.append(len(ids) + p - start)
                    inj_vecs.append(req.latent_embeds[p - req.latent_start])
            ids.extend(req.ids_slice(start, start + n))
            pos.extend(range(start, start + n))
            row_tok.extend([req.row] * n)
            last.append(len(ids) - 1)
        self.num_computed_tokens += len(ids)
        dev = self.device
        t, b = len(ids), len(batch.reqs)
        kv_lens = [s + n for s, n in zip(batch.starts, batch.q_lens)]
        mask_l = []
        if inj_rows:
            mask_l = [0] * t
            for r in inj_rows:
                mask_l[r] = 1
        # One host-to-device copy for every index vector of the batch:
        # ids [T] | positions [T] | page-table row of each token [T] | rows [B] | kv_lens [B]
        # | latent mask [T] (only with latent rows).
        packed = torch.tensor(ids + pos + row_tok + [r.row for r in batch.reqs] + kv_lens
                              + mask_l, dtype=torch.int64).to(dev, non_blocking=True)
        input_ids, positions = packed[:t], packed[t : 2 * t]
        rows, kv_dev = packed[3 * t : 3 * t + b], packed[3 * t + b : 3 * t + 2 * b]
        out_slots = self.table.table[packed[2 * t : 3 * t], positions]  # table[row, position]
        input_embeds = latent_mask = None
        if inj_rows:
            latent_mask = packed[3 * t + 2 * b :].bool()
            if len(inj_rows) == t:  # every row injects (a latent decode batch)
                input_embeds = torch.stack(inj_vecs)
            else:
                zero = inj_vecs[0].new_zeros(inj_vecs[0].shape)
                full = [zero] * t
                for r, v in zip(inj_rows, inj_vecs):
                    full[r] = v
                input_embeds = torch.stack(full)
        layout = BatchLayout(batch.q_lens, kv_lens, rows, out_slots)
        rec = RecurrentBatch.from_batch(batch, layout, self.table.table) if self.recurrent \
            else None
        decode = len(ids) == len(batch.reqs)
        # Rows of requests that asked for prompt logprobs and compute prompt tokens now.
        prompt_rows = [b for b, (r, st) in enumerate(zip(batch.reqs, batch.starts))
                       if r.params.prompt_logprobs is not None and st < len(r.prompt_ids)]
        self.prompt_hidden = []
        if (self.graphs is not None and decode and not prompt_rows
                and len(ids) <= self.graphs.max_bs
                and (rec is None or self.graphs.can_replay(rec))):
            self.num_graph_steps += 1
            logits, hidden = self.graphs.replay(input_ids, positions, rows, kv_dev, out_slots,
                                                input_embeds, latent_mask, rec)
            if rec is not None:
                rec.iters_used = list(rec.row_depths)
                rec.record(batch)
            captured = self.graphs.capture_buf[: len(ids)] if self.capture_layer >= 0 else None
            self.last_hidden_all = hidden  # one token per row: every position of the batch
            head_out = self.graphs.last_head
            keep = [i for i, s in enumerate(batch.sample) if s]
            if len(keep) < len(ids):  # a 1-token prefill chunk that does not end its prompt
                idx = torch.tensor(keep, dtype=torch.long, device=dev)
                logits, hidden = logits[idx], hidden[idx]
                captured = None if captured is None else captured[idx]
                if head_out is not None:
                    head_out = (head_out[0][idx],
                                None if head_out[1] is None else head_out[1][idx])
            self.last_captured, self.last_head_out = captured, head_out
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
        for b in prompt_rows:
            end = last[b] + 1
            self.prompt_hidden.append((batch.reqs[b], batch.starts[b],
                                       hidden[end - batch.q_lens[b] : end]))
        sample_rows = [i for i, s in zip(last, batch.sample) if s]
        idx = torch.tensor(sample_rows, dtype=torch.long, device=dev)
        self.last_head_out = None
        if capture_buf is not None:
            self.last_captured = capture_buf[idx]
        last_hidden = hidden[idx]
        return self.model.compute_logits(last_hidden), last_hidden
