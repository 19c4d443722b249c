"""Decode steps replayed from CUDA graphs, one per batch-size bucket (docs/internals.md)."""

from __future__ import annotations

import contextlib
import gc
from typing import Any

import torch

from latentserve.context import ForwardContext, set_context
from latentserve.latent.family import family_for
from latentserve.sampling import greedy_tokens, suppress_


@contextlib.contextmanager
def _gc_paused():
    """Collect now and keep the collector off inside: freeing an old graph during a capture
    invalidates it (cudaErrorStreamCaptureInvalidated)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def graph_buckets(max_bs: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, then every 16 up to ``max_bs`` (and ``max_bs``)."""
    sizes = {1, 2, 4, 8, *range(16, max_bs + 1, 16), max_bs}
    return sorted(b for b in sizes if b <= max_bs)


class CudaGraphRunner:
    """Captures ``model`` decode steps for each bucket (and loop depth) and replays them.

    ``capture_layer``: decoder layer whose output goes to ``capture_buf`` (-1: none).
    ``latent_capable``: bind the inject buffers (False only for a benchmark of their cost).

    ``replay`` takes ``[B]`` device tensors (``embeds [B, hidden]``, ``mask [B] bool`` or
    None, ``rec``: the forward context), B <= max_bs, and returns ``(logits [B, vocab]
    float32, hidden [B, hidden])``, views valid until the next replay; ``greedy``: their
    argmax ``[B] int64`` (``suppress`` ids masked first). The family's latent module runs
    in the decode graph too, on a side stream (``latent_outputs()`` reads its outputs): a
    closed-loop head from its anchor on (the captured layer, or the final hidden), a
    ``feedback`` module (CODI's ``prj``) on the final hidden, beside the LM head.
    """

    LM_HEAD_ARGMAX = True  # False: the argmax reads the logits back, not the LM head's (A/B)
    _wait = None  # the event the next replay waits for (wait_before_replay)

    def __init__(self, model, backend, kv_pool, table, max_bs: int, hidden_size: int,
                 dtype: torch.dtype, capture_layer: int = -1, latent_capable: bool = True,
                 with_greedy: bool = True, suppress: torch.Tensor | None = None):
        from latentserve.attention.triton_backend import TritonMeta

        dev = table.table.device
        self.buckets = graph_buckets(max_bs)
        n = self.buckets[-1]
        self.dummy_row = table.dummy_row
        self.table = table.table
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.rows = torch.full((n,), table.dummy_row, dtype=torch.int64, device=dev)
        self.kv_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.out_slots = torch.zeros(n, dtype=torch.int64, device=dev)
        self.embeds = torch.zeros(n, hidden_size, dtype=dtype, device=dev)
        self.mask = torch.zeros(n, dtype=torch.bool, device=dev)
        self._mask_hi = 0  # mask entries at or past this index are all False
        self._mask_ones = 0  # > 0: the mask is exactly this many leading True entries
        self.capture_buf = torch.zeros(n, hidden_size, dtype=dtype, device=dev)
        # A closed-loop head runs on its anchors: the captured layer, or the final-normed
        # hidden for a head that captures none (CoLaR).
        head = getattr(model, "latent_head", None)
        self.head = head if head is not None and capture_layer == head.capture_layer and \
            getattr(model, "latent_head_mode", None) == "closed_loop" else None
        self.capture_layer = capture_layer
        spec = getattr(model, "latent_spec", None)
        self.hooks = family_for(spec).graph_hooks(spec, model, n, dev)
        self.feedback: Any = self.hooks.feedback
        # The latent module runs in every step's graph, thinking rows or not, on a side stream
        # from its input on: beside the layers after a head's anchor layer, else beside the
        # LM head.
        self._side: torch.cuda.Stream | None = None
        self._side_out: tuple = ()
        self.graph_depths = list(self.hooks.depths)
        self._last, self._read = None, False  # (bucket, rows) of the last replay
        self._depth = self.graph_depths[0]  # the graph depth of the last replay
        # The graph also returns the logits' argmax (the greedy tokens), which the sampler
        # takes instead of launching the argmax after the replay; not on a tensor-parallel
        # worker rank (with_greedy=False: it never samples). ``suppress`` (``[K] int64``: ids
        # never sampled, CODI's eot) is masked to -inf in the graph, before the argmax.
        self.with_greedy = with_greedy
        self.suppress = suppress
        # the LM head's epilogue finds the argmax too (of the logits before any mask)
        self._head_argmax = (self.with_greedy and self.LM_HEAD_ARGMAX and suppress is None
                             and getattr(model, "compute_logits_greedy", None) is not None)
        self.greedy = None  # the last replay's greedy tokens (with_greedy)
        self.num_latent_replays = 0  # replays whose latent outputs were read
        q_start = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.latent_capable = latent_capable
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple] = {}
        pool = None
        # NOTE: under tensor parallelism NCCL's watchdog thread queries CUDA events while we
        # capture; "thread_local" forbids unsafe calls on this thread only.
        dist = torch.distributed
        mode = "thread_local" if dist.is_available() and dist.is_initialized() else "global"
        # Largest first, so smaller graphs reuse its pool.
        with _gc_paused():
            for depth, b in [(d, b) for d in reversed(self.graph_depths)
                             for b in reversed(self.buckets)]:
                meta = TritonMeta(self.rows[:b], q_start[: b + 1], self.kv_lens[:b],
                                  self.out_slots[:b], table.table, b, 1, True)
                ctx = ForwardContext(
                    meta, backend, kv_pool, capture_layer, self.capture_buf,
                    on_capture=self._start_side if self.head is not None and capture_layer >= 0
                    else None)
                self.hooks.bind(ctx, depth, b)  # e.g. a masked loop of `depth` iterations
                set_context(ctx)
                try:
                    with torch.inference_mode():
                        warm = self._forward(model, b)  # warm-up: compiles kernels outside capture
                        if self._head_argmax and model.lm_head_fast(warm[1]):
                            model.compute_logits(warm[1])  # and the eager steps' LM head variant
                        torch.cuda.synchronize()
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                            out = self._forward(model, b)
                finally:
                    set_context(None)
                pool = graph.pool()
                self.graphs[depth, b], self.outputs[depth, b] = graph, out
            if self.hooks.packed:  # compile replay_packed's kernel now, not in the first step
                from latentserve.ops.kernels.decode_inputs import unpack_decode_inputs

                unpack_decode_inputs(torch.zeros(2, dtype=torch.int64, device=dev), 0, 1, 0, None,
                                     self.table, self.dummy_row, self.ids, self.pos, self.rows,
                                     self.kv_lens, self.out_slots)
        torch.cuda.synchronize()

    def _latent_module(self, x: torch.Tensor) -> tuple:
        """The latent outputs of ``x`` (``[b, hidden]``): a head's ``(vecs, probs or None)``,
        feedback's ``(vecs,)``."""
        if self.head is not None:
            return tuple(self.head.serve_outputs(x))
        return (self.feedback(x),)

    def _start_side(self, x: torch.Tensor) -> None:
        """:meth:`_latent_module` of ``x`` (``ForwardContext.on_capture`` for a head's anchor
        layer), on a side stream while capturing on CUDA; ``_forward`` joins it."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            if self._side is None:
                self._side = torch.cuda.Stream(x.device)
            self._side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._side):
                self._side_out = self._latent_module(x)
        else:
            self._side_out = self._latent_module(x)

    def _forward(self, model, b):
        """``(logits, hidden, greedy or None)`` of a decode step of ``b`` rows, then the
        latent module's outputs (:meth:`_latent_module`)."""
        latent = (self.embeds[:b], self.mask[:b]) if self.latent_capable else ()
        hidden = model(self.ids[:b], self.pos[:b], *latent)
        if (self.head is not None and self.capture_layer < 0) or self.feedback is not None:
            self._start_side(hidden)  # on the final-normed hidden: beside the LM head
        if self._head_argmax:
            logits, greedy = model.compute_logits_greedy(hidden)
        else:
            # greedy in the graph: no launches per step
            logits = suppress_(model.compute_logits(hidden), self.suppress)
            greedy = greedy_tokens(logits) if self.with_greedy else None
        if self._side is not None and torch.cuda.is_current_stream_capturing():
            torch.cuda.current_stream().wait_stream(self._side)  # the head joins the capture
        side, self._side_out = self._side_out, ()
        return logits, hidden, greedy, *side

    def latent_outputs(self):
        """The latent outputs of the last replay's rows (a head's ``(vecs [n, H], probs [n] or
        None)``, feedback's ``vecs [n, H]``), views of the graph's static buffers;
        ``num_latent_replays`` counts the replays whose outputs were read. None without a
        latent module. Raises RuntimeError before any replay."""
        if self.head is None and self.feedback is None:
            return None
        if self._last is None:
            raise RuntimeError("latent_outputs() needs a decode-graph replay first")
        b, n = self._last
        if not self._read:
            self._read = True
            self.num_latent_replays += 1
        out = self.outputs[self._depth, b][3:]
        if self.head is not None:
            vecs, probs = out
            return vecs[:n], None if probs is None else probs[:n]
        return out[0][:n]

    @property
    def max_bs(self) -> int:
        return self.buckets[-1]

    def replay(self, ids, pos, rows, kv_lens, out_slots, embeds=None, mask=None, rec=None,
               mask_all: bool = False):
        n = ids.shape[0]
        b = next(x for x in self.buckets if x >= n)
        depth = self.graph_depths[0]
        if rec is not None:
            depth = self.hooks.depth_for(rec)
            self.hooks.refresh(rec, n, b)
        self.ids[:n].copy_(ids)
        self.pos[:n].copy_(pos)
        self.rows[:n].copy_(rows)
        self.kv_lens[:n].copy_(kv_lens)
        self.out_slots[:n].copy_(out_slots)
        if b > n:  # padded rows: dummy page-table row, one key, write to the dummy slot 0
            self.rows[n:b].fill_(self.dummy_row)
            self.kv_lens[n:b].fill_(1)
            self.out_slots[n:b].zero_()
        return self._launch(depth, b, n, embeds, mask, mask_all)

    def replay_packed(self, packed, n: int, num_pending: int = 0, pending=None, embeds=None,
                      mask=None, mask_all: bool = False, writes: tuple | None = None):
        """``replay`` from the batch's packed index vectors (``ops.kernels.decode_inputs``),
        with ``pending`` ids and page-table ``writes`` applied by the same kernel. Raises
        RuntimeError for a family with a forward context (``GraphHooks.packed``)."""
        from latentserve.ops.kernels.decode_inputs import unpack_decode_inputs

        if not self.hooks.packed:
            raise RuntimeError("replay_packed sets no forward context (recurrent depths)")
        b = next(x for x in self.buckets if x >= n)
        m, slots = (0, None) if writes is None else writes
        unpack_decode_inputs(packed, n, b, num_pending, pending, self.table, self.dummy_row,
                             self.ids, self.pos, self.rows, self.kv_lens, self.out_slots,
                             m, slots)
        return self._launch(0, b, n, embeds, mask, mask_all)

    def wait_before_replay(self, event) -> None:
        """Make the next replay wait for ``event`` (a side-stream copy still reading a static
        output; side-stream copies run in order, so only the latest is kept)."""
        self._wait = event

    def _launch(self, depth, b, n, embeds, mask, mask_all):
        # The latent inputs (see the class docstring), then the graph of (depth, bucket b).
        if embeds is None:
            if self._mask_hi:  # NOTE: plain steps skip the clear while the mask is all-False
                self.mask[: self._mask_hi].zero_()
                self._mask_hi = self._mask_ones = 0
        else:
            if not self.latent_capable:
                raise RuntimeError("latent rows need a latent-capable graph")
            self.embeds[:n].copy_(embeds)  # straight from the latent source (any float dtype)
            if not mask_all:
                self.mask[:n].copy_(mask)
                self._mask_ones = 0
            elif self._mask_ones != n:  # NOTE: consecutive all-latent steps keep the mask
                self.mask[:n].fill_(True)
                self._mask_ones = n
            if self._mask_hi > n:  # a larger batch's mask entries past this one
                self.mask[n : self._mask_hi].zero_()
            self._mask_hi = n
        if self._wait is not None:
            torch.cuda.current_stream().wait_event(self._wait)
            self._wait = None
        self.graphs[depth, b].replay()
        self._last, self._depth, self._read = (b, n), depth, False
        logits, hidden, greedy = self.outputs[depth, b][:3]
        self.greedy = None if greedy is None else greedy[:n]
        return logits[:n], hidden[:n]
