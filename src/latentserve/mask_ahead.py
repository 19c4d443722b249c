"""Grammar bitmask rows of the next step, filled in a worker thread while the host goes on.
Design notes: docs/internals.md, "latentserve.mask_ahead"."""

from __future__ import annotations

import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from latentserve.core import ReqStatus
from latentserve.token_masks import FilledRows, accept_each, bitmask_width, new_batcher

# NOTE: while a worker fills, a thread waiting for the GIL gets it within this many seconds
# (the interpreter's default, 5 ms, can hold the worker back a whole step while the engine's
# thread runs Python); the default is back once no fill is in flight
SWITCH_S = 0.001
_in_flight = [0, 0.0]  # fills in flight in this process, the switch interval before them
_lock = threading.Lock()


class MasksAhead:
    """One worker thread that feeds a step's sampled tokens to the grammars and fills their
    next bitmask rows (docs/internals.md). ``enabled`` False: :meth:`start` does nothing.
    ``waited``: seconds the engine's thread has waited for the worker."""

    def __init__(self, vocab_size: int, enabled: bool = True):
        self.width = bitmask_width(vocab_size)
        self.enabled = enabled
        self._pool: ThreadPoolExecutor | None = None  # and its batcher: made on first use
        self._batcher = None
        self._bits = torch.empty(0, self.width, dtype=torch.int32)
        self._job: Future | None = None
        self._filled: dict = {}
        self.waited = 0.0

    def start(self, rows: list, tokens: torch.Tensor | None = None, event=None) -> None:
        """Fill ahead for the sampling rows ``rows`` (``(req, index of its pending id in
        output_ids, or None)``) of running requests inside their grammar: ``tokens[j]``
        (``[len(rows)] int64`` on the host, readable once ``event`` completes) is row j's
        pending token; the worker feeds each matcher its unseen answer tokens, then fills."""
        self.wait()
        self._filled = {}
        if not self.enabled:
            return
        work = []
        for j, (req, idx) in enumerate(rows):
            c = req.constraint
            if (c is None or not c.grammar_on or req.answer_start is None
                    or req.status is ReqStatus.FINISHED):
                continue
            base = req.answer_start + c.grammar_from + c.consumed
            tail = req.output_ids[base:]  # a copy: the engine's thread changes output_ids
            work.append((req, tail, idx - base if idx is not None and idx >= base else None, j))
        if not work:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="latentserve-masks")
            self._batcher = new_batcher()
        if self._bits.shape[0] < len(work):
            self._bits = torch.empty(max(len(work), 2 * self._bits.shape[0]), self.width,
                                     dtype=torch.int32)
        _switch_faster()
        try:
            self._job = self._pool.submit(self._fill, work, tokens, event)
        except BaseException:
            _switch_back()
            raise

    def wait(self) -> None:
        """Wait for the worker (re-raising what it raised)."""
        job, self._job = self._job, None
        if job is None:
            return
        t0 = time.perf_counter()
        try:
            self._filled = job.result()
        finally:
            self.waited += time.perf_counter() - t0
            _switch_back()

    def take(self) -> FilledRows | None:
        """The rows filled by the last :meth:`start` (None: none), after :meth:`wait`; each
        is given once."""
        self.wait()
        filled, self._filled = self._filled, {}
        return FilledRows(self._bits.numpy(), filled) if filled else None

    def _fill(self, work: list, tokens: torch.Tensor | None, event) -> dict:
        """The worker: ``id(req) -> (req, row in _bits, consumed)``."""
        if event is not None:
            event.synchronize()  # NOTE: releases the GIL, as xgrammar's batched fill does
        toks = None if tokens is None else tokens.tolist()
        for _, tail, at, j in work:
            if at is not None:
                tail[at] = toks[j]
        k = 0  # each row's k-th new token; one round for a decode step
        while True:
            feed = [(req.constraint, tail[k]) for req, tail, _, _ in work
                    if k < len(tail) and req.constraint.grammar_on]
            if not feed:
                break
            accept_each([c for c, _ in feed], [t for _, t in feed])
            k += 1
        filled: dict = {}
        matchers = []
        for req, _, _, _ in work:
            c = req.constraint
            if c.grammar_on:
                filled[id(req)] = (req, len(matchers), c.consumed)
                matchers.append(c.matcher)
        if matchers:
            self._batcher.batch_fill_next_token_bitmask(matchers, self._bits,
                                                        list(range(len(matchers))))
        return filled


def _switch_faster() -> None:
    """A fill starts: the switch interval down to :data:`SWITCH_S` (the first one in flight)."""
    with _lock:
        if _in_flight[0] == 0:
            _in_flight[1] = sys.getswitchinterval()
            sys.setswitchinterval(min(SWITCH_S, _in_flight[1]))
        _in_flight[0] += 1


def _switch_back() -> None:
    """A fill was waited for: the interval back as it was once none is in flight."""
    with _lock:
        _in_flight[0] -= 1
        if _in_flight[0] == 0:
            sys.setswitchinterval(_in_flight[1])
