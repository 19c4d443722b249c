"""The loop manager: looped latent blocks (PCCoT, LOTUS) re-forwarded in place.

Design notes: docs/internals.md, "latentserve.latent.loop".
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from latentserve.core import LatentState, Req
from latentserve.latent.family import Admission, Family
from latentserve.latent.vectors import as_rows


@dataclass(slots=True)
class LoopState(LatentState):
    """One looped request's block.

    ``block_start``: the index in ``ids`` of the first block position; ``iterations``: passes
    after pass 0 (the request's latent budget); ``passes_done``: block passes completed;
    ``outputs``: ``[block_size + 1, hidden]`` post-final-norm outputs at positions
    ``block_start - 1 .. block_end - 1`` of the current pass (row 0: the start token's);
    ``next_inputs``: ``[block_size, hidden]`` inputs of the next pass, set when a pass ends;
    ``slots``: the block's KV slot ids as the first pass wrote them (checked on every later
    pass; reset by a preemption); ``slot_checks``: passes whose slots were checked;
    ``pass_chunk``: positions per forward inside a pass (0: the whole block at once).
    """

    block_start: int
    block_size: int
    iterations: int
    passes_done: int = 0
    outputs: Any = None
    next_inputs: Any = None
    slots: Any = None
    slot_checks: int = 0
    pass_chunk: int = 0

    # NOTE: pass_chunk > 0 splits every pass into forwards of that many positions; results
    # are unchanged. Benchmarks set 1 to run the same thoughts position by position.

    @property
    def block_end(self) -> int:
        return self.block_start + self.block_size

    def cacheable_len(self, req: Req) -> int:
        """The prompt before the block: the block is rewritten in place every pass."""
        return req.latent_start


def start_request(req: Req, spec, iterations: int) -> None:
    """Make ``req`` (prompt ids not yet extended) a looped request: the spec's start ids
    are appended to its prompt and its block starts right after them."""
    req.prompt_ids += spec.start_ids
    req.latent_start = len(req.prompt_ids)
    req.latent_budget = iterations
    req.answer_start = None
    req.state = LoopState(req.latent_start, spec.block_size, iterations)


def chunk(req: Req, n: int) -> int:
    """Tokens a looped request computes this step, given the scheduler's ``n``: at most
    ``pass_chunk`` inside a pass when it is set."""
    st = req.state
    if st.pass_chunk and req.answer_start is None and req.num_computed >= st.block_start:
        return min(n, st.pass_chunk)
    return n


def in_pass(req: Req) -> bool:
    """True while a looped request has a block pass to run (block laid, answer not begun)."""
    return req.state is not None and req.answer_start is None \
        and len(req.output_ids) == req.state.block_size


def passes_first(running: list[Req]) -> list[Req]:
    """``running`` in the loop manager's priority order: requests with prompt tokens still to
    prefill, then those in a block pass, then the rest (decode rows); each group keeps its
    order. The scheduler hands out the step's token budget in this order (and admits new
    requests after it), so it only matters when the budget runs short. The same list order
    when no request is in a pass."""
    passes = [r for r in running if in_pass(r)]
    if not passes:
        return list(running)
    prefill = [r for r in running if not in_pass(r) and r.num_computed < len(r.prompt_ids)]
    chosen = {id(r) for r in passes + prefill}
    return prefill + passes + [r for r in running if id(r) not in chosen]


def _in_block_phase(req: Req) -> bool:
    return req.state is not None and req.answer_start is None


def after_forward(model, table: torch.Tensor, batch, hidden: torch.Tensor) -> None:
    """Gather what a forward computed for the looped rows of ``batch``.

    ``hidden``: ``[num_tokens, hidden]`` post-final-norm outputs of every position of the
    batch (rows in batch order). Outputs at ``block_start - 1 .. block_end - 1`` go to each
    request's ``LoopState.outputs``; a row that covers the whole block records (first pass,
    or a prefill after a preemption) or checks (later passes) the block's slots in
    ``table`` (``[rows, max_len]`` page table); rows that end a pass with passes left get
    their ``next_inputs``, computed by ``model.latent_feedback`` in one batch. A traced
    request (``return_latent_trace``) that ends a pass gets that pass's lens entries, one
    LM-head call for all of them (:func:`_trace_passes`).

    Raises RuntimeError when a pass finds the block's slots moved (the engine's contract is
    that a block is allocated once and rewritten in place).
    """
    off, ending, traced = 0, [], []
    for req, start, n, sample in zip(batch.reqs, batch.starts, batch.q_lens, batch.sample):
        lo_row = off
        off += n
        if not _in_block_phase(req):
            continue
        st = req.state
        first, last = st.block_start - 1, st.block_end  # positions kept: [first, last)
        lo, hi = max(start, first), min(start + n, last)
        if lo < hi:
            if st.outputs is None:
                st.outputs = hidden.new_zeros(st.block_size + 1, hidden.shape[-1])
            st.outputs[lo - first : hi - first] = hidden[lo_row + lo - start : lo_row + hi - start]
        if start + n != st.block_end or len(req.output_ids) != st.block_size:
            continue  # not the end of a pass
        if start <= st.block_start:  # the whole pass in one row
            slots = table[req.row, st.block_start : st.block_end]
            if start < st.block_start or st.slots is None:
                st.slots = slots.clone()
            elif not torch.equal(slots, st.slots):
                raise RuntimeError(f"request {req.rid}: loop block slots moved between passes "
                                   f"({st.slots.tolist()} -> {slots.tolist()})")
            else:
                st.slot_checks += 1
        if sample and st.passes_done < st.iterations:
            ending.append(req)
        if sample and req.params.return_latent_trace:
            traced.append(req)
    if traced:
        _trace_passes(model, traced)
    if not ending:
        return
    jacobi = model.latent_spec.loop_rule == "jacobi"
    src = torch.cat([r.state.outputs[:-1] if jacobi else r.state.outputs[1:] for r in ending])
    with torch.inference_mode():
        vecs = model.latent_feedback(src)
    for i, req in enumerate(ending):
        k = req.state.block_size
        req.state.next_inputs = vecs[i * k : (i + 1) * k]


def _trace_passes(model, reqs: list[Req]) -> None:
    """Append to each of ``reqs`` (each just ended a pass) one trace entry per block position:
    :func:`~latentserve.latent.lens.lens_entries` of the pass's outputs at the block
    positions (``LoopState.outputs[1:]``, ``[block_size, hidden]``) with ``"pass"`` (1-based:
    ``passes_done + 1``) and ``"position"`` (1-based)."""
    from latentserve.latent.lens import lens_entries

    entries = lens_entries(model, torch.cat([r.state.outputs[1:] for r in reqs]))
    i = 0
    for req in reqs:
        st = req.state
        for j in range(st.block_size):
            req.latent_trace.append({**entries[i], "pass": st.passes_done + 1,
                                     "position": j + 1})
            i += 1


def advance(req: Req, spec) -> bool:
    """Move a looped request past a forward that sampled for it (the sampled token is
    discarded unless this returns True). After the prompt: lay down the block. After a
    pass with passes left: the next pass's inputs replace the block's, and ``num_computed``
    goes back to the block start (the slots stay in the page table, so no allocation).
    After the last pass: force ``end_ids``; returns True when there are none (the sampled
    token is then the first answer token)."""
    st = req.state
    if not req.output_ids:
        req.output_ids.extend([spec.latent_id] * st.block_size)
        return False
    st.passes_done += 1
    if st.passes_done <= st.iterations:
        req.latent_embeds = as_rows(st.next_inputs)  # (tensor, row) entries, no views
        st.next_inputs = None
        req.num_computed = st.block_start
        return False
    req.output_ids.extend(spec.end_ids)
    req.answer_start = len(req.output_ids)
    return not spec.end_ids


def on_preempt(req: Req) -> None:
    """A preempted looped request loses its slots: the recomputed prefill records new ones."""
    if req.state is not None:
        req.state.slots = None


class LoopFamily(Family):
    """The engine's :class:`~latentserve.latent.family.Family` for looped-block models
    (``LatentSpec.kind == "loop"``): ``latent_budget`` is the number of passes over the
    block after the first (:func:`start_request`); after each forward :func:`after_forward`
    lays out the next pass's inputs, so there are no per-step latent inputs."""

    # a pass's next inputs are computed on the device from the forward's outputs
    # (after_forward) and the passes move on by counts, never by a sampled token
    overlaps = True

    budgeted = True
    traced = True
    streams_steps = True
    description = "a looped-block model"

    def admit(self, prompt_ids, params) -> Admission:
        if self.engine.tp is not None and params.return_latent_trace:
            raise ValueError("return_latent_trace is not supported with "
                             "tensor_parallel_size > 1 on looped-block models")
        spec = self.spec
        budget = spec.resolve_budget(params.latent_budget)
        return Admission(params, spec.prompt_extra(budget),
                         lambda req: start_request(req, spec, budget))

    def thinking(self, req: Req) -> bool:
        return req.answer_start is None and len(req.latent_embeds) < req.latent_budget

    def after_forward(self, batch) -> None:
        runner = self.engine.runner
        after_forward(runner.model, self.engine.cache.table.table, batch,
                      runner.last_hidden_all)

    def order(self, running: list[Req]) -> list[Req]:
        return passes_first(running)

    def chunk(self, req: Req, n: int) -> int:
        return chunk(req, n)

    def forces_one_by_one(self, req: Req) -> bool:
        return False

    def on_preempt(self, req: Req) -> None:
        on_preempt(req)

    def advance(self, req: Req, vec) -> bool:
        return advance(req, self.spec)

    def output_fields(self, req: Req, done: bool) -> dict:
        st = req.state
        return {"latent_steps": st.block_size * st.passes_done}
