"""The engine's shared vocabulary: a request (``Req``) and its status."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from latentserve.sampling_params import SamplingParams


class ReqStatus(enum.Enum):
    WAITING = "waiting"  # not admitted: holds no page-table row and no KV slots
    RUNNING = "running"  # admitted: has a row; KV for ids[:num_computed] is in the pool
    FINISHED = "finished"


class LatentState:
    """The base of a family's per-request state (``Req.state``): what the core asks of it."""

    __slots__ = ()

    def cacheable_len(self, req: Req) -> int:
        """``req.cacheable_len``: by default everything before the first latent position."""
        return req.latent_start if req.latent_embeds else req.seq_len


_NO_STATE = LatentState()


@dataclass(eq=False, slots=True)
class Req:
    """One request inside the engine. Counts are positions in ``ids = prompt_ids + output_ids``
    (``output_ids``: latent placeholders, forced transition tokens and answer tokens;
    ``answer_ids`` the answer): ``num_computed`` have KV; ``num_allocated`` slots are in the
    page-table row; the first ``cache_len`` belong to the radix cache (locked through
    ``cache_node``). Latent phase: positions
    ``[latent_start, latent_start + len(latent_embeds))`` take ``latent_embeds`` entries
    ``(tensor, row)`` as input (``latent/vectors.py``); ``answer_start`` (index in
    ``output_ids``) is None until the transition tokens are appended. Plain requests:
    ``latent_budget == 0``, ``answer_start == 0``. ``state``: the family's :class:`LatentState`
    (``RecurrentState``, ``HeadSettings``, ``LoopState``; None for plain and feedback requests).
    ``cache_salt`` (0 = none) separates prefix-cache entries whose KV differs for the same ids.
    ``eos_from``: EOS ends the request only from answer token ``eos_from`` (1-based; 0: any).
    ``constraint``: the ``token_masks.RequestMask``, or None. ``forced_close``: the family
    appends closing ids after the latent phase (``LatentSpec.end_ids``), so no token sampled
    in that phase becomes an answer token (:attr:`samples_answer`)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival: int = 0
    output_ids: list[int] = field(default_factory=list)
    status: ReqStatus = ReqStatus.WAITING
    row: int = -1
    num_computed: int = 0
    num_allocated: int = 0
    cache_len: int = 0
    cache_node: Any = None
    num_cached_prompt: int | None = None
    finish_reason: str | None = None
    generator: Any = None  # torch.Generator when params.seed is set
    latent_budget: int = 0
    latent_start: int = 0
    latent_embeds: list = field(default_factory=list)
    answer_start: int | None = 0
    latent_trace: list = field(default_factory=list)  # return_latent_trace (docs/server.md)
    cache_salt: int = 0
    state: LatentState | None = None
    eos_from: int = 0
    constraint: Any = None
    forced_close: bool = False

    @property
    def samples_answer(self) -> bool:
        """Whether the token sampled for this request's next row may be an answer token: in
        the answer, or in a latent phase without ``forced_close`` (the token sampled at the
        step ending the phase is the answer's first). Token masks, ``logit_bias`` and the
        penalties apply to such rows only; a latent phase's other tokens decide the phase
        (CoLaR's ``###`` stop) or are dropped."""
        return self.answer_start is not None or not self.forced_close

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def ids_slice(self, start: int, stop: int) -> list[int]:
        """``ids[start:stop]`` without building ``ids`` (O(stop - start), not O(seq_len):
        the model runner takes each row's new ids this way every step)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p : stop - p]
        if stop <= p:
            return self.prompt_ids[start:stop]
        return self.prompt_ids[start:] + self.output_ids[: stop - p]

    @property
    def seq_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def answer_ids(self) -> list[int]:
        return [] if self.answer_start is None else self.output_ids[self.answer_start :]

    @property
    def cache_key(self) -> list[int]:
        """The ids as the radix cache sees them: ``ids``, each shifted into the request's
        ``cache_salt`` namespace (ids stay below 2**32), so differently salted requests never
        share a prefix."""
        if not self.cache_salt:
            return self.ids
        off = self.cache_salt << 32
        return [off + i for i in self.ids]

    @property
    def cacheable_len(self) -> int:
        """Leading positions whose KV depends on token ids alone (safe for the radix cache):
        everything before the first latent position, unless the family's state says
        otherwise (``LatentState.cacheable_len``: a looped block, an early-exit rule)."""
        return (self.state if self.state is not None else _NO_STATE).cacheable_len(self)

    @property
    def num_pending(self) -> int:
        """Tokens whose KV still has to be computed before the next token can be sampled."""
        return self.seq_len - self.num_computed
