"""Looped latent blocks (PCCoT, LOTUS) re-forwarded in place (docs/internals.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from latentserve.core import LatentState, Req
from latentserve.latent.family import BudgetedFamily
from latentserve.latent.lens import lens_entries
from latentserve.latent.vectors import as_rows


@dataclass(slots=True)
class LoopState(LatentState):
    """One looped request's block: ``block_start`` (index in ``ids``), ``iterations``
    (passes after pass 0), ``outputs`` ``[block_size + 1, hidden]`` (final-normed, positions
    ``block_start - 1 ..``), ``next_inputs`` ``[block_size, hidden]``, ``slots`` (the first
    pass's KV slots), ``slot_checks``, ``pass_chunk`` (positions per forward; 0: all)."""

    block_start: int
    block_size: int
    iterations: int
    passes_done: int = 0
    outputs: Any = None
    next_inputs: Any = None
    slots: Any = None
    slot_checks: int = 0
    pass_chunk: int = 0

    @property
    def block_end(self) -> int:
        return self.block_start + self.block_size

    def cacheable_len(self, req: Req) -> int:
        """The prompt before the block: the block is rewritten in place every pass."""
        return req.latent_start


def in_pass(req: Req) -> bool:
    """True while a looped request has a block pass to run (block laid, answer not begun)."""
    return req.state is not None and req.answer_start is None \
        and len(req.output_ids) == req.state.block_size


def passes_first(running: list[Req]) -> list[Req]:
    """``running`` ordered prefill rows, then block passes, then the rest, each group in
    its order (the order the step's token budget is handed out)."""
    if not any(in_pass(r) for r in running):
        return list(running)
    return sorted(running, key=lambda r: 1 if in_pass(r)  # stable: groups keep their order
                  else 0 if r.num_computed < len(r.prompt_ids) else 2)


class LoopFamily(BudgetedFamily):
    """The ``Family`` of looped-block models: ``latent_budget`` is the passes after the first."""

    description = "a looped-block model"

    def cap_thinking(self, params):
        """The block's positions are fixed (passes add none): ValueError when there are more
        than ``thinking_token_budget``."""
        if self.spec.block_size > params.thinking_token_budget:
            raise ValueError(f"thinking_token_budget must be at least this model's "
                             f"{self.spec.block_size} latent positions, got "
                             f"{params.thinking_token_budget}")
        return params

    def budget_without_thinking(self, requested: int | None) -> int:
        """ValueError: the block's latent positions are always there (the budget adds passes)."""
        raise ValueError(f"thinking cannot be false on {self.description}: its block of "
                         f"{self.spec.block_size} latent positions always runs (latent_budget "
                         "sets its passes after the first)")

    def new_state(self, req: Req, budget: int) -> LoopState:
        return LoopState(req.latent_start, self.spec.block_size, budget)

    def after_forward(self, batch) -> None:
        """Gather the looped rows' outputs (``[num_tokens, hidden]``) into their state, record
        or check the block's slots, and lay out ``next_inputs`` of rows ending a pass.
        Raises RuntimeError when a pass finds the block's slots moved."""
        model, hidden = self.engine.runner.model, self.engine.runner.last_hidden_all
        table = self.engine.cache.table.table
        off, ending, traced = 0, [], []
        for req, start, n, sample in zip(batch.reqs, batch.starts, batch.q_lens, batch.sample):
            lo_row = off
            off += n
            if req.state is None or req.answer_start is not None:
                continue
            st = req.state
            first, last = st.block_start - 1, st.block_end  # positions kept: [first, last)
            lo, hi = max(start, first), min(start + n, last)
            if lo < hi:
                if st.outputs is None:
                    st.outputs = hidden.new_zeros(st.block_size + 1, hidden.shape[-1])
                st.outputs[lo - first : hi - first] = \
                    hidden[lo_row + lo - start : lo_row + hi - start]
            if start + n != st.block_end or len(req.output_ids) != st.block_size:
                continue  # not the end of a pass
            if start <= st.block_start:  # the whole pass in one row
                slots = table[req.row, st.block_start : st.block_end]
                if start < st.block_start or st.slots is None:
                    st.slots = slots.clone()
                elif not torch.equal(slots, st.slots):
                    raise RuntimeError(f"request {req.rid}: loop block slots moved between "
                                       f"passes ({st.slots.tolist()} -> {slots.tolist()})")
                else:
                    st.slot_checks += 1
            if sample and st.passes_done < st.iterations:
                ending.append(req)
            if sample and req.params.return_latent_trace:
                traced.append(req)
        if traced:  # one lens entry per block position, "pass" and "position" 1-based
            entries = iter(lens_entries(model, torch.cat([r.state.outputs[1:] for r in traced])))
            for req in traced:
                req.latent_trace += [{**next(entries), "pass": req.state.passes_done + 1,
                                      "position": j + 1} for j in range(req.state.block_size)]
        if not ending:
            return
        jacobi = model.latent_spec.loop_rule == "jacobi"
        src = torch.cat([r.state.outputs[:-1] if jacobi else r.state.outputs[1:]
                         for r in ending])
        with torch.inference_mode():
            vecs = model.latent_feedback(src)
        for req, inputs in zip(ending, vecs.split(self.spec.block_size)):
            req.state.next_inputs = inputs

    def order(self, running: list[Req]) -> list[Req]:
        return passes_first(running)

    def chunk(self, req: Req, n: int) -> int:
        """At most ``pass_chunk`` tokens inside a pass when it is set."""
        st = req.state
        if st.pass_chunk and req.answer_start is None and req.num_computed >= st.block_start:
            return min(n, st.pass_chunk)
        return n

    def forces_one_by_one(self, req: Req) -> bool:
        return False

    def on_preempt(self, req: Req) -> None:
        """The recomputed prefill records the block's new slots."""
        if req.state is not None:
            req.state.slots = None

    def advance(self, req: Req, vec) -> bool:
        """After the prompt: lay down the block; after a pass: rewind to the block start
        with the next inputs; after the last pass: force ``end_ids``."""
        st, spec = req.state, self.spec
        if not req.output_ids:
            req.output_ids.extend([spec.latent_id] * st.block_size)
            return False
        st.passes_done += 1
        if st.passes_done <= st.iterations:
            req.latent_embeds = as_rows(st.next_inputs)
            st.next_inputs = None
            req.num_computed = st.block_start
            return False
        req.output_ids.extend(spec.end_ids)
        req.answer_start = len(req.output_ids)
        return not spec.end_ids

    def output_fields(self, req: Req, done: bool) -> dict:
        st = req.state
        return {"latent_steps": st.block_size * st.passes_done}
