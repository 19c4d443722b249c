"""The engine's one interface to a model's latent reasoning: :class:`Family`.

Design notes: docs/internals.md, "latentserve.latent.family".
"""

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
    """What :meth:`Family.admit` decides for one request: its (possibly adjusted) params,
    the KV positions the family adds before the answer (``extra``: start, latent and
    transition ids), and ``start(req)``, which makes a fresh ``Req`` of the prompt a request
    of the family (None: nothing to do)."""

    params: SamplingParams
    extra: int = 0
    start: Callable[[Req], None] | None = None


class GraphHooks:
    """What a family adds to the decode graphs (``engine/cuda_graph.py``), asked by the
    graph runner; this base adds nothing: one graph per batch-size bucket, no forward
    context, no latent graph.

    ``depths``: the loop trip counts captured, one graph per ``(depth, bucket)`` (a plain
    model: ``[0]``). ``feedback``: a module the latent graph runs on the decode graph's
    final hidden rows (``[n, hidden] -> [n, hidden]`` next input embeddings, CODI's
    ``prj``), or None. ``packed``: a batch may replay from its packed index vectors alone
    (``CudaGraphRunner.replay_packed``: no forward context to copy)."""

    depths = [0]
    feedback = None
    packed = True

    def bind(self, ctx, depth: int, b: int) -> None:
        """Set the family's fields of ``ctx`` (the ``ForwardContext`` a graph of ``depth``
        and bucket ``b`` is captured with) to static buffers."""

    def fits(self, rec) -> bool:
        """Whether a batch with forward context ``rec`` (``Family.forward_context``) may
        replay a captured graph."""
        return True

    def depth_for(self, rec) -> int:
        """The captured depth a batch with forward context ``rec`` replays."""
        return self.depths[0]

    def refresh(self, rec, n: int, b: int) -> None:
        """Before a replay of ``n`` rows (bucket ``b``, rows past ``n`` padding): copy
        ``rec`` into the static buffers ``bind`` bound."""

    def replayed(self, rec, n: int) -> None:
        """After a replay of ``n`` rows: fill ``rec`` with what the graph wrote (the eager
        forward fills it itself)."""


class Family:
    """A plain model: no latent phase, no latent budget.

    Class attributes (what the engine's generic checks ask): ``budgeted`` (``latent_budget``
    applies and ``--max-latent-budget`` caps it), ``traced`` (``return_latent_trace`` has
    something to return), ``streams_steps`` (``stream_latent_steps`` has steps to stream),
    ``takes_exit_fields`` (the ``exit_*`` fields), ``takes_exit_semantics`` (a server
    default ``exit_semantics`` other than ``"engine"``), ``takes_head_controls`` (CoLaR's
    ``compression_factor`` / ``latent_temperature``), ``overlaps`` (steps may run under the
    overlap scheduler, ``engine/overlap.py``: nothing the family does on the host needs the
    previous step's tokens, ``latent_inputs`` does not read ``tokens`` and ``budget_spent``
    never finishes a request, unless it ``decides_late``; ``after_forward`` and
    ``latent_inputs`` run at a batch's launch, before the batch launched before it is
    finished, ``advance`` after that), ``decides_late`` (under the
    overlap scheduler a latent step's ``advance`` at launch is provisional, settled by
    :meth:`resolve` when the step's sampled token reaches the host; its budget and output
    wait for that), ``packed_replay`` (a decode batch may replay its graph from the
    packed index vectors alone: no per-forward context), ``description`` (for error
    messages).
    """

    budgeted = False
    overlaps = True
    decides_late = False
    packed_replay = True
    traced = False
    streams_steps = False
    takes_exit_fields = False
    takes_head_controls = False
    takes_exit_semantics = False
    description = "a model without latent reasoning"

    def __init__(self, spec, engine):
        self.spec = spec
        self.engine = engine

    def setup(self) -> None:
        """Once, after the engine's model runner exists (e.g. the layer a head reads)."""

    def admit(self, prompt_ids: list[int], params: SamplingParams) -> Admission:
        """Resolve ``params`` for this family without changing any state. Raises ValueError
        naming the field for a request the family cannot run."""
        if params.latent_budget:
            raise ValueError("latent_budget must be 0 or null: this model does no latent "
                             "reasoning")
        return Admission(params)

    def thinking(self, req: Req) -> bool:
        """Whether ``req``'s next input is a latent vector."""
        return False

    def after_forward(self, batch) -> None:
        """After every forward, before sampling (a looped block prepares its next pass)."""

    def latent_inputs(self, reqs: list[Req], logits, last_hidden, tokens: list[int]
                      ) -> list | None:
        """The next latent input of each sampling row of ``reqs`` (``(tensor, row)``, see
        ``latent/vectors.py``) or None per row; None when no row has one. ``tokens``: the
        rows' sampled ids, or None under the overlap scheduler (not on the host yet); a
        family that ``decides_late`` then returns whatever its ``advance`` decides from,
        changing no request state (the batch before may still be undone)."""
        return None

    @staticmethod
    def forward_context(batch, layout, page_table):
        """What the model's forward reads for ``batch`` besides its inputs
        (``ForwardContext.recurrent``; the model runner calls it on every rank), or None."""
        return None

    @staticmethod
    def graph_hooks(spec, model, max_bs: int, device, depths=None) -> GraphHooks:
        """The decode graphs' :class:`GraphHooks` for ``model`` (static buffers for
        ``max_bs`` rows on ``device``; ``depths``: loop trip counts to capture, None for the
        family's default)."""
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
        """Whether forced ids that just ended ``req``'s latent phase may go one per step
        (``Scheduler.forced_one_by_one``)."""
        return True

    def on_preempt(self, req: Req) -> None:
        """``req`` lost its KV and waits to be recomputed."""

    def advance(self, req: Req, vec) -> bool:
        """Move a latent-phase ``req`` past a forward that sampled for it (``vec``: its entry
        of :meth:`latent_inputs`); the sampled token is discarded unless this returns True
        (it is then the first answer token)."""
        raise RuntimeError(f"request {req.rid} has no latent phase on {self.description}")

    def resolve(self, req: Req, token: int) -> bool:
        """Settle the latent step ``advance`` took provisionally for ``req`` at a batch's
        launch (overlap mode, ``decides_late`` families), now that the step's sampled
        ``token`` is on the host: True when it stands; False when the family undid it
        (``req``'s ids, latents and state as before that ``advance``), and the scheduler then
        ends the latent phase (``advance(req, None)``)."""
        return True

    def budget_spent(self, req: Req, max_model_len: int) -> str | None:
        """A finish reason for a latent-phase ``req`` that spent its budget, else None."""
        return None

    def latents_count_as_output(self, req: Req) -> bool:
        """Whether ``req``'s latent positions count against ``max_tokens``."""
        return False

    def truncate(self, req: Req) -> None:
        """``req.output_ids`` were cut (overlap mode: the request finished on a token of an
        earlier batch than the last it was launched in); drop the family's per-token records
        past them."""

    def output_fields(self, req: Req, done: bool) -> dict:
        """The family's ``StepOutput`` fields for ``req`` (``done``: its final output)."""
        return {"latent_steps": len(req.latent_embeds)}


def family_for(spec) -> type[Family]:
    """The ``Family`` class of a ``LatentSpec`` (None: a plain model)."""
    if spec is None:
        return Family
    module, name = FAMILIES[spec.kind].split(":")
    return getattr(importlib.import_module(module), name)
