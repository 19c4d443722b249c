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


@dataclass(eq=False, slots=True)
class Req:
    """One request inside the engine.

    Token bookkeeping (all counts are token positions in ``ids = prompt_ids + output_ids``;
    ``output_ids`` holds every generated position: latent placeholders, forced transition
    tokens and answer tokens; ``answer_ids`` is the answer part):
    ``num_computed`` tokens have KV in the pool; ``num_allocated`` slots are written in the
    request's page-table row (``>= num_computed``); ``cache_len`` leading slots belong to the
    radix cache (matched at admission, locked through ``cache_node``). ``num_cached_prompt``
    counts prompt tokens served by the prefix cache at first admission (for stats and tests).

    Latent phase machine (models with a ``LatentSpec``): positions
    ``[latent_start, latent_start + len(latent_embeds))`` take ``latent_embeds`` as their
    input instead of a token embedding (one ``(tensor, row)`` entry per position, the vector
    being ``tensor[row]``: ``latent/vectors.py``); ``answer_start`` is None until the
    transition tokens are appended, then the index in ``output_ids`` where the answer begins.
    Plain requests have ``latent_budget == 0`` and ``answer_start == 0`` from the start.

    ``state``: the family's own per-request state (a :class:`LatentState`, set when the
    family admits the request; None for plain and feedback requests):
    ``latent.recurrent.RecurrentState`` (recurrent depth: ``latent_budget`` is the
    recurrence count, the state holds the exit rule and the iterations run per sampled
    token), ``latent.head.HeadSettings`` (compression heads: resolved controls and latent
    stats; latent positions, the closing ids and the answer all count against
    ``params.max_tokens``, already raised by the answer-budget floor, except for CoLaR, whose
    ``max_tokens`` counts answer tokens only) or ``latent.loop.LoopState`` (looped blocks:
    the block ``[latent_start, latent_start + block_size)`` is re-forwarded in place,
    ``latent_embeds`` holding the current pass's inputs, empty for pass 0).
    ``cache_salt`` (0 = none) keeps a request's prefix-cache entries apart from requests whose
    KV differs for the same ids (another recurrence depth or exit rule).

    ``eos_from``: an EOS ends the request only as answer token number ``eos_from`` or later
    (1-based; 0: any), the family's upstream rule (``LatentSpec.upstream_eos_from``) for a
    request with ``upstream_stop_rules``.

    ``constraint``: the request's ``token_masks.RequestMask`` when its params mask tokens
    (allowed ids, bad words, ``min_tokens``, a grammar), else None.
    """

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
    latent_embeds: list = field(default_factory=list)  # (tensor, row) per latent position
    answer_start: int | None = 0
    # return_latent_trace: per latent step {"norm", "top_tokens", "top_probs"[, "stop_prob"]}
    # (feedback models, compression heads: latent/lens.py), per
    # sampled token {"depth"[, "readout_step", "exit_probs"]} (recurrent depth:
    # RecurrentBatch.record), per block position of each pass a lens entry + "pass",
    # "position" (looped blocks: loop._trace_passes)
    latent_trace: list = field(default_factory=list)
    cache_salt: int = 0
    state: LatentState | None = None  # the family's per-request state (see above)
    eos_from: int = 0  # an EOS ends the answer from this 1-based answer token on (0: any)
    constraint: Any = None  # token_masks.RequestMask: params that mask the sampled tokens

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
        ids = self.ids
        if not self.cache_salt:
            return ids
        off = self.cache_salt << 32
        return [off + i for i in ids]

    @property
    def cacheable_len(self) -> int:
        """Leading positions whose KV depends on token ids alone (safe for the radix cache):
        everything before the first latent position, unless the family's state says
        otherwise (``LatentState.cacheable_len``: a looped block, an early-exit rule)."""
        if self.state is not None:
            return self.state.cacheable_len(self)
        return self.latent_start if self.latent_embeds else self.seq_len

    @property
    def num_pending(self) -> int:
        """Tokens whose KV still has to be computed before the next token can be sampled."""
        return self.seq_len - self.num_computed
