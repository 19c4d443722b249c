"""Continuous-batching scheduler: each step, one decode token per running request, then
prefill/extend chunks within a token budget. Out of KV slots: evict the radix cache, then
preempt the most recently admitted request (recomputed later), never crash."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from latentserve.core import Req, ReqStatus
from latentserve.outputs import StepOutput
from latentserve.scheduler.cache import CacheManager

PENDING_ID = -1  # overlap mode: the output id of a token sampled by a forward still running


@dataclass(slots=True)
class ScheduledBatch:
    """One forward: ``reqs[b]`` computes ids ``[starts[b], starts[b] + q_lens[b])``;
    ``sample[b]``: that reaches the end of its ids, so a token is sampled."""

    reqs: list[Req]
    starts: list[int]
    q_lens: list[int]
    sample: list[bool]


class Scheduler:
    """Owns the waiting queue and the running set. ``max_num_batched_tokens``: tokens per
    forward (a decode row counts one); ``family``: the served ``latent.family.Family``;
    ``forced_one_by_one`` (CUDA-graph decode): forced ids of a latent phase run one per step."""

    def __init__(self, cache: CacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, eos_ids: set[int], family):
        self.cache = cache
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.eos_ids = eos_ids
        self.family = family
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.num_preemptions = 0
        # Prompt tokens at each request's first admission, and how many the cache served.
        self.prefix_queries = self.prefix_hits = 0
        self._aborted: list[Req] = []
        # overlap mode: id(req) -> seq position from which a late-decided latent step was
        # undone (finalize_launched), for the advance of the batch launched after it
        self._undone: dict[int, int] = {}
        self.forced_one_by_one = False
        self._max_forced = len(family.spec.end_ids) if family.spec is not None else 0

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def abort(self, rid: str) -> None:
        """Finish ``rid`` with reason "abort" (reported on the next step); unknown ids are
        ignored."""
        for queue in (self.waiting, self.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    self.cache.release_many([req])
                    self._finish(req, "abort")
                    self._aborted.append(req)
                    return

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._aborted)

    def schedule(self) -> ScheduledBatch | None:
        self._undone.clear()  # only the advance right after the finalize that set them
        batch = ScheduledBatch([], [], [], [])
        budget = self.max_num_batched_tokens
        # 1. Running requests, oldest first (or in the family's order): decode rows and
        #    unfinished prefill chunks.
        reserve = self.cache.reserve
        for req in self.family.order(self.running):
            if budget <= 0:
                break
            if req.status is not ReqStatus.RUNNING:
                continue  # preempted while an earlier row grew
            n = self._chunk(req, budget)
            if not reserve(req, req.num_computed + n):
                in_batch, victim = {id(r) for r in batch.reqs}, None
                while not reserve(req, req.num_computed + n):
                    # NOTE: the most recently admitted request not already in this batch.
                    victim = next(r for r in reversed(self.running) if id(r) not in in_batch)
                    self.running.remove(victim)
                    self._preempt(victim)
                    if victim is req:
                        break
                if victim is req:
                    continue
            self._add_to_batch(batch, req, n)
            budget -= n
        self.cache.flush()
        # 2. Admit waiting requests in arrival order while rows, slots and budget last.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if not self.family.admits_now(req, budget) or not self.cache.admit(req):
                break
            self.waiting.popleft()
            if req.num_cached_prompt is None:
                req.num_cached_prompt = req.num_computed
                self.prefix_queries += len(req.prompt_ids)
                self.prefix_hits += req.num_computed
            req.status = ReqStatus.RUNNING
            self.running.append(req)
            n = self._chunk(req, budget)
            self._add_to_batch(batch, req, n)
            budget -= n
        return batch if batch.reqs else None

    def _chunk(self, req: Req, budget: int) -> int:
        """Tokens ``req`` computes this step within ``budget``, as the family chunks it."""
        n = min(req.num_pending, budget)
        if (self.forced_one_by_one and 1 < n <= self._max_forced
                and req.answer_start is not None and self.family.forces_one_by_one(req)
                and req.num_computed >= len(req.prompt_ids)):
            return 1
        return self.family.chunk(req, n)

    @staticmethod
    def _add_to_batch(batch: ScheduledBatch, req: Req, n: int) -> None:
        batch.reqs.append(req)
        batch.starts.append(req.num_computed)
        batch.q_lens.append(n)
        batch.sample.append(req.num_computed + n == req.seq_len)

    def _preempt(self, req: Req) -> None:
        self.cache.release_many([req])
        self.family.on_preempt(req)
        req.status = ReqStatus.WAITING
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def postprocess(self, batch: ScheduledBatch, tokens: list[int],
                    latents: list | None = None) -> list[StepOutput]:
        """Advance each request past this step and retire finished ones; ``tokens`` and
        ``latents`` (next latent input or None) per sampling row."""
        outs, self._aborted = [self._output(r, []) for r in self._aborted], []
        done: list[Req] = []  # finished this step: their KV is released together, at the end
        try:
            it = iter(tokens)
            lat = iter(latents or [None] * len(tokens))
            for req, n, sample in zip(batch.reqs, batch.q_lens, batch.sample):
                req.num_computed += n
                if not sample:
                    continue
                tok, vec = next(it), next(lat)
                if req.answer_start is None and not self.family.advance(req, vec):
                    out = self._thought(req, done)  # a latent step, no answer token
                    if out is not None:
                        outs.append(out)
                    continue
                req.output_ids.append(tok)
                reason = self._finish_reason(req, tok)
                if reason is not None:
                    self._end(req, reason, done)
                outs.append(self._output(req, [tok]))
        finally:  # released even when a later row raises: no KV leaks
            self.cache.release_many(done)
        return outs

    def _thought(self, req: Req, done: list) -> StepOutput | None:
        """The output of a latent step ``req`` has just taken (None: none). A request whose
        budget is spent (``Family.budget_spent``) finishes and joins ``done``."""
        reason = self.family.budget_spent(req, self.max_model_len)
        if reason is not None:  # e.g. head latent steps spend the output budget
            self._end(req, reason, done)
            return self._output(req, [])
        if req.params.stream_latent_steps:  # progress of a latent step, no token
            return self._output(req, [])
        return None

    def _end(self, req: Req, reason: str, done: list) -> None:
        """Finish ``req``: out of the running set (its KV released with ``done``), or out of
        the waiting queue when it was preempted after its forward was launched (overlap)."""
        if req.status is ReqStatus.RUNNING:
            self.running.remove(req)
            done.append(req)
        else:
            self.waiting.remove(req)
        self._finish(req, reason)

    # ----- overlap mode (engine/overlap.py): the step's tokens arrive one step later -----

    def advance_launched(self, batch: ScheduledBatch, latents: list | None = None
                         ) -> list[tuple[Req, int | None, StepOutput | None, bool]]:
        """:meth:`postprocess` before the tokens are known: answer rows append ``PENDING_ID``.
        Returns per sampling row ``(req, index in output_ids or None, output or None, late)``.
        Raises RuntimeError when a late-deciding family finishes a request in its latent phase."""
        pending: list[tuple[Req, int | None, StepOutput | None, bool]] = []
        lat = iter(latents or ())
        done: list[Req] = []
        late = self.family.decides_late
        undone, self._undone = self._undone, {}

        def skip(req):  # a discarded row: nothing to finish
            return req, None, None, False

        try:
            for req, start, n, sample in zip(batch.reqs, batch.starts, batch.q_lens,
                                              batch.sample):
                vec = next(lat, None) if sample else None
                if req.status is ReqStatus.FINISHED:  # on a token of the batch before
                    if sample:
                        pending.append(skip(req))
                    continue
                req.num_computed += n
                cut = undone.get(id(req))
                if cut is not None:
                    req.num_computed = min(req.num_computed, cut)
                    if start + n > cut:  # computed from an input that was undone
                        if sample:
                            pending.append(skip(req))
                        continue
                if not sample:
                    continue
                if req.answer_start is None:
                    if late:
                        answers = self.family.advance(req, vec)
                        idx = len(req.output_ids) if answers else None
                        if answers:
                            req.output_ids.append(PENDING_ID)
                        pending.append((req, idx, None, True))
                        continue
                    if not self.family.advance(req, vec):
                        out = self._thought(req, done)
                        if done:
                            raise RuntimeError(f"request {req.rid} finished in its latent "
                                               "phase under the overlap scheduler")
                        pending.append((req, None, out, False))
                        continue
                pending.append((req, len(req.output_ids), None, False))
                req.output_ids.append(PENDING_ID)
        finally:
            self.cache.release_many(done)
        return pending

    def finalize_launched(self, pending: list[tuple[Req, int | None, StepOutput | None, bool]],
                          tokens: list[int]) -> list[StepOutput]:
        """Write an :meth:`advance_launched`'s tokens over their pending ids and retire the
        requests they finish; late latent steps are settled first (``Family.resolve``)."""
        outs, self._aborted = [self._output(r, []) for r in self._aborted], []
        done: list[Req] = []  # finished now: their KV is released together, at the end
        try:
            for (req, idx, tick, late), tok in zip(pending, tokens):
                if req.status is ReqStatus.FINISHED:
                    continue
                if late:
                    if not self.family.resolve(req, tok):
                        self._undone[id(req)] = req.seq_len  # ids from here on changed
                        idx = None
                        if self.family.advance(req, None):
                            idx = len(req.output_ids)
                            req.output_ids.append(tok)
                    if idx is None:
                        tick = self._thought(req, done)
                if idx is None:  # a latent step
                    if tick is not None:
                        outs.append(tick)
                    continue
                req.output_ids[idx] = tok
                reason = self._finish_reason(req, tok, idx + 1)
                if reason is not None:
                    del req.output_ids[idx + 1 :]
                    self.family.truncate(req)
                    req.num_computed = min(req.num_computed, req.seq_len)
                    self._end(req, reason, done)
                outs.append(self._output(req, [tok]))
        finally:  # released even when a later row raises: no KV leaks
            self.cache.release_many(done)
        return outs

    def _output(self, req: Req, new: list[int]) -> StepOutput:
        done = req.status == ReqStatus.FINISHED
        trace = req.latent_trace if req.params.return_latent_trace else None  # [] if none ran
        if not done:  # a latent step's progress output carries that step's entry
            tick = not new and req.params.stream_latent_steps
            trace = trace[-1:] if trace and tick else None
        return StepOutput(req.rid, new, done, req.finish_reason if done else None,
                          len(req.prompt_ids), req.num_cached_prompt or 0,
                          latent_trace=trace, **self.family.output_fields(req, done))

    def drain_aborted(self) -> list[StepOutput]:
        """Outputs of requests aborted since the last step (when no batch ran)."""
        return self.postprocess(ScheduledBatch([], [], [], []), [])

    def _finish_reason(self, req: Req, tok: int, num_out: int | None = None) -> str | None:
        """Why ``req`` finishes with ``tok`` as its last output id (``num_out`` ids up to it;
        None: all), or None."""
        p = req.params
        n = len(req.output_ids) if num_out is None else num_out
        answer = 0 if req.answer_start is None else n - req.answer_start  # tok included
        if ((tok in self.eos_ids and not p.ignore_eos and answer >= req.eos_from)
                or tok in p.stop_token_ids):
            return "stop"
        c = req.constraint
        # only an end id ends a grammar (an ignored EOS): fed here; other ids are fed when
        # the next mask is built
        if c is not None and tok in c.end_ids and req.answer_start is not None:
            c.sync(req.output_ids, req.answer_start, n)
            if c.terminated:
                return "stop"
        # answer = len(req.answer_ids), without copying them
        spent = n if self.family.latents_count_as_output(req) else answer
        assert p.max_tokens is not None  # LLMEngine.add_request resolves None
        if spent >= p.max_tokens or len(req.prompt_ids) + n >= self.max_model_len:
            return "length"
        return None

    @staticmethod
    def _finish(req: Req, reason: str) -> None:
        req.status = ReqStatus.FINISHED
        req.finish_reason = reason
