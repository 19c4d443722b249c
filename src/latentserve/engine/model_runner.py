"""Turns a ``ScheduledBatch`` into tensors, runs the model once (eagerly, or by replaying a
captured CUDA graph for decode batches) and returns the logits of the rows that sample."""

from __future__ import annotations

from array import array

import torch

from latentserve.attention.base import AttentionBackend, BatchLayout
from latentserve.context import ForwardContext, set_context
from latentserve.engine.cuda_graph import CudaGraphRunner
from latentserve.kvcache.pool import KVPool, PageTable
from latentserve.latent import vectors as latent_vectors
from latentserve.latent.family import family_for
from latentserve.sampling import suppress_
from latentserve.scheduler.scheduler import ScheduledBatch
from latentserve.staging import HostToDevice, to_device


def pending_row(req, start: int, n: int, src_of: dict[int, int] | None) -> int | None:
    """The previous forward's token row ``req``'s chunk takes as its last id (overlap), or None."""
    if src_of and start + n == req.seq_len:
        return src_of.get(id(req))
    return None


class ModelRunner:
    """Runs forwards of ``model`` over the paged ``kv_pool``.

    ``run(batch)`` returns ``(logits [S, vocab] float32, last_hidden [S, hidden])`` for the
    sampling rows in batch order, the latent spec's ``suppress_ids`` at -inf (CODI's eot: never
    sampled); latent positions take ``req.latent_embeds``.

    After a run: ``last_captured`` ``[S, hidden]`` (residual after ``capture_layer`` layers);
    ``last_hidden_all`` ``[num_tokens, hidden]``; ``last_greedy`` ``[S] int64`` or None;
    ``replayed`` (outputs may be graph buffers: copy to keep); ``prompt_hidden`` ``(req,
    start, [q_len, hidden])``; counters ``num_computed_tokens``, ``num_graph_steps``.
    """

    def __init__(self, model, kv_pool: KVPool, table: PageTable, backend: AttentionBackend,
                 device: torch.device):
        self.model = model
        self.kv_pool = kv_pool
        self.table = table
        self.backend = backend
        self.device = device
        self.graphs: CudaGraphRunner | None = None  # once capture_graphs() ran
        # residual after this many decoder layers goes to last_captured (-1: none); set it
        # before capture_graphs, which bakes it into the graphs
        self.capture_layer = -1
        self.last_captured: torch.Tensor | None = None
        self.last_hidden_all: torch.Tensor | None = None
        self._keep: torch.Tensor | None = None  # sampling rows of the last replay (None: all)
        self.num_computed_tokens = 0
        self.num_graph_steps = 0
        self.replayed = False
        self.last_greedy = None
        self._all_true = torch.ones(0, dtype=torch.bool, device=device)
        # the batch's packed index vectors, copied while the previous batch's kernels run
        self._to_device = HostToDevice(device, side_stream=True)
        self.prompt_hidden: list = []
        spec = getattr(model, "latent_spec", None)
        self.family = family_for(spec)  # its class only
        # ids never sampled, masked in place (in the graphs too): no copy of the logits a step
        self.suppress = (torch.tensor(spec.suppress_ids, dtype=torch.long, device=device)
                         if spec is not None and spec.suppress_ids else None)

    def release_graphs(self) -> None:
        """Drop the captured decode graphs and wait for the device (before leaving a TP
        process group: graphs that captured NCCL collectives keep the communicator busy)."""
        self.graphs = None
        if torch.device(self.device).type == "cuda":
            torch.cuda.synchronize(self.device)

    def latent_outputs(self):
        """The decode graph's latent outputs (``CudaGraphRunner.latent_outputs``) of the
        sampling rows after a replayed run, else None."""
        if not self.replayed or self.graphs is None:
            return None
        out = self.graphs.latent_outputs()
        if out is None or self._keep is None:
            return out
        if isinstance(out, tuple):
            return out[0][self._keep], None if out[1] is None else out[1][self._keep]
        return out[self._keep]

    def capture_graphs(self, max_bs: int, hidden_size: int, dtype: torch.dtype,
                       with_greedy: bool = True) -> None:
        """Capture decode graphs for batch sizes up to ``max_bs`` (CUDA + Triton only);
        ``with_greedy=False`` leaves the greedy argmax out of them (a rank that never samples)."""
        self.graphs = CudaGraphRunner(self.model, self.backend, self.kv_pool, self.table,
                                      max_bs, hidden_size, dtype, self.capture_layer,
                                      with_greedy=with_greedy, suppress=self.suppress)

    @torch.inference_mode()
    def run(self, batch: ScheduledBatch, pending: tuple | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """``pending`` (overlap): ``(tokens [S'] int64 on the device, {id(req): row})``, the
        previous forward's tokens, substituted for pending ids on the device."""
        ids: list[int] = []
        pos: list[int] = []
        last: list[int] = []
        row_tok: list[int] = []
        sub_dst: list[int] = []  # pending ids: token row <- row of the previous tokens
        sub_src: list[int] = []
        src_of = pending[1] if pending is not None else None
        inj_rows: list[int] = []  # token rows that take a latent vector, and their entries
        inj: list = []
        for req, start, n in zip(batch.reqs, batch.starts, batch.q_lens):
            emb = req.latent_embeds
            if n == 1:  # a decode row (the usual one, or a latent step): no slices, no ranges
                k = len(ids)
                last.append(k)
                ids.extend(req.ids_slice(start, start + 1))
                pos.append(start)
                row_tok.append(req.row)
                if emb and 0 <= start - req.latent_start < len(emb):
                    inj_rows.append(k)
                    inj.append(emb[start - req.latent_start])
                j = pending_row(req, start, 1, src_of)
                if j is not None:
                    sub_dst.append(k)
                    sub_src.append(j)
                continue
            if emb:  # latent span [lo, hi) of this chunk takes vectors (indices in emb)
                lo = start - req.latent_start
                lo, hi = max(lo, 0), min(lo + n, len(emb))
                if lo < hi:
                    base = len(ids) - start + req.latent_start
                    inj_rows.extend(range(base + lo, base + hi))
                    inj.extend(emb[lo:hi])
            ids.extend(req.ids_slice(start, start + n))
            pos.extend(range(start, start + n))
            row_tok.extend([req.row] * n)
            last.append(len(ids) - 1)
            j = pending_row(req, start, n, src_of)
            if j is not None:
                sub_dst.append(len(ids) - 1)
                sub_src.append(j)
        self.num_computed_tokens += len(ids)
        dev = self.device
        t, b = len(ids), len(batch.reqs)
        kv_lens = [s + n for s, n in zip(batch.starts, batch.q_lens)]
        mask_l, src, src_rows = ([], None, []) if not inj_rows else \
            latent_vectors.injection_plan(inj_rows, inj, t)
        # Rows of requests that asked for prompt logprobs and compute prompt tokens now.
        prompt_rows = [b for b, (r, st) in enumerate(zip(batch.reqs, batch.starts))
                       if r.params.prompt_logprobs is not None and st < len(r.prompt_ids)]
        fits_graph = (self.graphs is not None and t == b and not prompt_rows
                      and t <= self.graphs.max_bs)
        # A plain decode batch that fits a graph: one kernel unpacks the inputs into the
        # graph's buffers (ops.kernels.decode_inputs), so nothing below touches them. It
        # also makes the scheduler's staged page-table writes (PageTable.stage).
        packed_replay = fits_graph and self.graphs is not None and self.graphs.hooks.packed
        staged = self.table.staged if packed_replay else None  # taken at the replay
        # One host-to-device copy (array('q'), pinned buffer) for every index vector:
        # ids [T] | positions [T] | page-table row per token [T] | rows [B] | kv_lens [B]
        # | latent mask [T] (some rows take no vector) | latent source rows [T] (not one
        # slice) | pending token rows, their rows in the previous tokens | staged writes.
        cells = array("q", ids + pos + row_tok + [r.row for r in batch.reqs] + kv_lens
                      + mask_l + src_rows + sub_dst + sub_src)
        if staged is not None:
            cells.extend(staged[0])
        packed = self._to_device.copy(cells)
        input_ids, positions = packed[:t], packed[t : 2 * t]
        rows, kv_dev = packed[3 * t : 3 * t + b], packed[3 * t + b : 3 * t + 2 * b]
        out_slots = None
        if not packed_replay:
            if sub_dst:  # the previous step's tokens, still on the device
                assert pending is not None
                k = len(sub_dst)
                input_ids[packed[-2 * k : -k]] = pending[0][packed[-k:]]
            out_slots = self.table.table[packed[2 * t : 3 * t], positions]  # table[row, pos]
        input_embeds = latent_mask = None
        if inj_rows:
            if mask_l:
                latent_mask = packed[3 * t + 2 * b : 4 * t + 2 * b].bool()
            else:  # every row: a slice of a cached all-True mask (read only)
                if self._all_true.shape[0] < t:
                    self._all_true = torch.ones(t, dtype=torch.bool, device=dev)
                latent_mask = self._all_true[:t]
            if src is None:  # vectors from several tensors (a recomputed prefill)
                input_embeds = latent_vectors.stack_at(inj_rows, inj, t)
            elif src_rows:
                lo = 3 * t + 2 * b + len(mask_l)
                input_embeds = src.index_select(0, packed[lo : lo + len(src_rows)])
            else:
                input_embeds = src
        # out_slots None: a packed replay's input kernel reads the slots from the page table
        layout = BatchLayout(batch.q_lens, kv_lens, rows, out_slots)  # type: ignore[arg-type]
        # NOTE: reading table.table applies the staged page-table writes, which a packed
        # replay leaves to its input kernel; a family with a forward context never packs
        rec = None if packed_replay else self.family.forward_context(batch, layout,
                                                                     self.table.table)
        self.prompt_hidden = []
        mask_all = bool(inj_rows) and not mask_l
        graphs = self.graphs
        if graphs is not None and (packed_replay or (fits_graph
                                                    and (rec is None or graphs.hooks.fits(rec)))):
            self.num_graph_steps += 1
            self.replayed = True
            if packed_replay:
                self.table.take_staged()  # the input kernel writes them
                try:
                    prev_tokens = pending[0] if pending is not None and sub_dst else None
                    logits, hidden = graphs.replay_packed(
                        packed, t, len(sub_dst), prev_tokens,
                        input_embeds, latent_mask, mask_all=mask_all,
                        writes=None if staged is None else staged[1:])
                except BaseException:
                    # put them back: a later read applies them (writing a cell twice is
                    # harmless, should the kernel have run)
                    if staged is not None:
                        self.table.stage(*staged)
                    raise
            else:
                logits, hidden = graphs.replay(input_ids, positions, rows, kv_dev,
                                                    out_slots, input_embeds, latent_mask, rec,
                                                    mask_all=mask_all)
            if rec is not None:
                graphs.hooks.replayed(rec, len(ids))
                rec.record(batch)
            captured = graphs.capture_buf[: len(ids)] if self.capture_layer >= 0 else None
            self.last_hidden_all = hidden  # one token per row: every position of the batch
            self.last_greedy = graphs.greedy
            self._keep = None
            if not all(batch.sample):  # a 1-token prefill chunk that does not end its prompt
                keep = [i for i, s in enumerate(batch.sample) if s]
                self._keep = idx = to_device(keep, torch.long, dev)
                logits, hidden = logits[idx], hidden[idx]
                captured = None if captured is None else captured[idx]
                self.last_greedy = None if self.last_greedy is None else self.last_greedy[idx]
            self.last_captured = captured
            return logits, hidden
        self.replayed = False
        self.last_greedy = None
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
        idx = to_device(sample_rows, torch.long, dev)
        if capture_buf is not None:
            self.last_captured = capture_buf[idx]
        last_hidden = hidden[idx]
        return suppress_(self.model.compute_logits(last_hidden), self.suppress), last_hidden
