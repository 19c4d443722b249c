"""The engine's one interface to a model's latent reasoning: :class:`Family` (docs/internals.md)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from latentserve.core import Req
from latentserve.sampling_params import SamplingParams

# LatentSpec.kind -> "module:class" of its Family (imported on first use).
FAMILIES = {
    "feedback": "latentserve.latent.feedback_loop:FeedbackFamily",
    "head": "latentserve.latent.head_loop:HeadFamily",
    "loop": "latentserve.latent.loop:LoopFamily",
    "recurrent": "latentserve.latent.recurrent:RecurrentFamily",
}


@dataclass(slots=True)
class Admission:
    """:meth:`Family.admit`'s decision: params, KV positions added before the answer
    (``extra``), and ``start(req)`` to set up a fresh ``Req`` (None: nothing)."""

    params: SamplingParams
    extra: int = 0
    start: Callable[[Req], None] | None = None


class GraphHooks:
    """What a family adds to the decode graphs (``engine/cuda_graph.py``); this base: nothing.

    ``depths``: loop trip counts, one graph per ``(depth, bucket)``; ``feedback``: module on
    the final hidden rows (``[n, hidden] -> [n, hidden]``) or None; ``packed``: a batch
    replays from its packed index vectors alone."""

    depths = [0]
    feedback = None
    packed = True

    def bind(self, ctx, depth: int, b: int) -> None:
        """Point the family's fields of the capture's ``ForwardContext`` at static buffers."""

    def fits(self, rec) -> bool:
        """Whether a batch with forward context ``rec`` may replay a captured graph."""
        return True

    def depth_for(self, rec) -> int:
        """The captured depth a batch with forward context ``rec`` replays."""
        return self.depths[0]

    def refresh(self, rec, n: int, b: int) -> None:
        """Before a replay of ``n`` rows (bucket ``b``): copy ``rec`` into the static buffers."""

    def replayed(self, rec, n: int) -> None:
        """After a replay of ``n`` rows: fill ``rec`` with what the graph wrote."""


class Family:
    """A plain model: no latent phase, no latent budget.

    Class attributes the engine's checks ask: ``budgeted`` (``latent_budget`` applies),
    ``traced`` / ``streams_steps`` / ``traced_under_tp`` (trace and step streaming work),
    ``takes_exit_fields``, ``takes_exit_semantics``, ``takes_head_controls``, ``overlaps``
    (steps may run under ``engine/overlap.py``), ``decides_late`` (``advance`` at launch is
    provisional, settled by :meth:`resolve`), ``description``.
    """

    traced_under_tp = overlaps = True
    budgeted = decides_late = traced = streams_steps = False
    takes_exit_fields = takes_head_controls = takes_exit_semantics = False
    description = "a model without latent reasoning"

    def __init__(self, spec, engine):
        self.spec = spec
        self.engine = engine

    def setup(self) -> None:
        """Once, after the engine's model runner exists (e.g. the layer a head reads)."""

    def admit(self, prompt_ids: list[int], params: SamplingParams) -> Admission:
        """Resolve ``params`` without changing state; ValueError naming the field."""
        if params.latent_budget:
            raise ValueError("latent_budget must be 0 or null: this model does no latent "
                             "reasoning")
        return Admission(params)

    def cap_thinking(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the latent phase held to ``thinking_token_budget`` positions (the
        engine has no reasoning parser); ValueError where the model has no such phase."""
        raise ValueError("thinking_token_budget needs a model that reasons in <think> text "
                         "(an engine with reasoning_parser) or in latent positions (feedback, "
                         f"looped-block or compression-head), not {self.description}")

    def thinking(self, req: Req) -> bool:
        """Whether ``req``'s next input is a latent vector."""
        return False

    def after_forward(self, batch) -> None:
        """After every forward, before sampling (a looped block prepares its next pass)."""

    def latent_inputs(self, reqs: list[Req], logits, last_hidden, tokens: list[int]
                      ) -> list | None:
        """Per sampling row its next latent input (a ``(tensor, row)`` entry) or None; None
        when no row has one. ``tokens`` None under the overlap scheduler: a family that
        ``decides_late`` returns what ``advance`` decides from."""
        return None

    @staticmethod
    def forward_context(batch, layout, page_table):
        """``ForwardContext.recurrent`` for ``batch``, or None."""
        return None

    @staticmethod
    def graph_hooks(spec, model, max_bs: int, device) -> GraphHooks:
        """The decode graphs' :class:`GraphHooks`."""
        return GraphHooks()

    # ----- the scheduler's hooks (scheduler/scheduler.py) -----

    def order(self, running: list[Req]) -> list[Req]:
        """The running requests in the order the step's token budget is handed out."""
        return list(running)

    def admits_now(self, req: Req, budget: int) -> bool:
        """Whether waiting ``req`` may be admitted with ``budget`` tokens left this step."""
        return True

    def chunk(self, req: Req, n: int) -> int:
        """Tokens ``req`` computes this step, given the scheduler's ``n``."""
        return n

    def forces_one_by_one(self, req: Req) -> bool:
        """Whether forced ids ending the latent phase may go one per step."""
        return True

    def on_preempt(self, req: Req) -> None:
        """``req`` lost its KV and waits to be recomputed."""

    def advance(self, req: Req, vec) -> bool:
        """Move ``req`` past a forward that sampled for it (``vec``: its latent input);
        True: the sampled token is the first answer token."""
        raise RuntimeError(f"request {req.rid} has no latent phase on {self.description}")

    def resolve(self, req: Req, token: int) -> bool:
        """Settle the provisional ``advance`` with the sampled ``token``; False: undone."""
        return True

    def budget_spent(self, req: Req, max_model_len: int) -> str | None:
        """A finish reason for a latent-phase ``req`` that spent its budget, else None."""
        return None

    def latents_count_as_output(self, req: Req) -> bool:
        """Whether ``req``'s latent positions count against ``max_tokens``."""
        return False

    def truncate(self, req: Req) -> None:
        """``req.output_ids`` were cut (overlap mode); drop per-token records past them."""

    def output_fields(self, req: Req, done: bool) -> dict:
        """The family's ``StepOutput`` fields for ``req`` (``done``: its final output)."""
        return {"latent_steps": len(req.latent_embeds)}


class BudgetedFamily(Family):
    """A family whose latent phase follows the start ids and runs ``latent_budget`` steps
    (feedback, loop); traced and streamed step by step, not under tensor parallelism."""

    budgeted = traced = streams_steps = True
    traced_under_tp = False

    def new_state(self, req: Req, budget: int):
        """``Req.state`` of a request admitted with ``budget`` (None: none)."""
        return None

    def admit(self, prompt_ids: list[int], params: SamplingParams) -> Admission:
        spec = self.spec
        requested = params.latent_budget
        if params.thinking is False:
            requested = self.budget_without_thinking(requested)
        budget = spec.resolve_budget(requested)

        def start(req: Req) -> None:
            req.prompt_ids += spec.start_ids
            req.latent_budget, req.latent_start = budget, len(req.prompt_ids)
            req.answer_start = None
            req.state = self.new_state(req, budget)

        return Admission(params, spec.prompt_extra(budget), start)

    def budget_without_thinking(self, requested: int | None) -> int:
        """The budget of a request with ``thinking`` false: no latent steps. ValueError when
        it also asks for some (``requested`` > 0)."""
        if requested:
            raise ValueError(f"thinking is false but latent_budget is {requested}; send one "
                             "or the other")
        return 0

    def thinking(self, req: Req) -> bool:
        return req.answer_start is None and len(req.latent_embeds) < req.latent_budget


def family_for(spec) -> type[Family]:
    """The ``Family`` class of a ``LatentSpec`` (None: a plain model)."""
    if spec is None:
        return Family
    module, name = FAMILIES[spec.kind].split(":")
    return getattr(importlib.import_module(module), name)
