"""What a latent-reasoning model declares to the engine: ``LatentSpec``.

A plain model declares none and nothing changes for it. The engine reads only these fields;
each family's own mechanics (the feedback projection, head modules, ...) stay in the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any


@dataclass(frozen=True, slots=True)
class LatentSpec:
    """A model's latent-reasoning contract.

    Attributes:
        kind: ``"feedback"`` (COCONUT, CODI, SIM-CoT: the last hidden, maybe projected, is the
            next input embedding) or ``"recurrent"`` (Huginn, Ouro: every token loops a block of
            layers; the budget is the number of recurrences per token, see
            ``latent/recurrent.py``; no start/end ids, no latent positions) or ``"head"``
            (a compression head with a learned stop, ``latent/head.py``: start/end ids are
            the thinking span's opening/closing, ``latent_id`` the reserved pad id; the
            budget fields are unused, each request's controls are ``head.HeadSettings``).
        family: the upstream family name (``"coconut"``, ``"codi"``, ``"huginn"``, ``"ouro"``).
        default_budget: latent steps (recurrent: recurrences) when a request does not say
            (``latent_budget=None``).
        max_budget: the largest budget a request may ask for (the server's cap; for a
            recurrent model it also sizes the KV banks).
        min_budget: the smallest budget a request may ask for (Ouro needs one loop).
        default_exit: recurrent only: the ``latent.recurrent.ExitRule`` a request gets when it
            names no exit criterion (Ouro's config ``early_exit_threshold``), or None.
        positions_per_thought: KV positions one latent step writes (1 for feedback latents).
        start_ids: token ids appended to every prompt before the latent phase (COCONUT
            ``<|start-latent|>``; CODI ``bot``). Part of the prompt for caching.
        end_ids: token ids forced after the latent phase, before the answer (COCONUT
            ``<|end-latent|>``; CODI ``eot``).
        latent_id: the id recorded at latent positions (COCONUT ``<|latent|>``); it never
            reaches the embedding lookup because those rows are replaced.
        suppress_ids: ids never sampled (their logits are set to -inf), e.g. CODI's ``eot``,
            which upstream drops from the answer's argmax.
        block_size: loop only: latent positions in the block (PCCoT ``num_latent_tokens``).
        loop_rule: loop only: which output feeds block position j in the next pass:
            ``"jacobi"`` (PCCoT: the output of position j-1, the first one reading the start
            token's) or ``"same"`` (LOTUS as documented in docs/models.md: position j's own).
        controls: head only: the per-request controls the head takes (``SamplingParams``
            field names, ``latent.head.HEAD_FIELDS``); a request setting another head
            control is refused.
        max_compression_factor: head only, CoLaR: the largest thinking speed (compression
            factor) a request may ask for (``colar_config.json``); 0 for other models.
        upstream_eos_from: the family's upstream stop rule, for requests with
            ``upstream_stop_rules``: an EOS ends the request only when it is answer token
            number ``upstream_eos_from`` or later (1-based; an earlier EOS is kept as an
            answer token and decoding goes on). 0: upstream stops on the first EOS as the
            engine does, and ``upstream_stop_rules`` is refused.
    """

    kind: str
    family: str
    default_budget: int
    max_budget: int = 64
    positions_per_thought: int = 1
    start_ids: tuple[int, ...] = field(default_factory=tuple)
    end_ids: tuple[int, ...] = field(default_factory=tuple)
    latent_id: int = 0
    suppress_ids: tuple[int, ...] = field(default_factory=tuple)
    min_budget: int = 0
    default_exit: Any = None
    block_size: int = 0
    loop_rule: str = ""
    controls: tuple[str, ...] = ()
    max_compression_factor: int = 0
    upstream_eos_from: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("feedback", "recurrent", "head", "loop"):
            raise ValueError(f"LatentSpec.kind must be 'feedback', 'recurrent', 'head' or "
                             f"'loop', got {self.kind!r}")
        if self.kind == "loop" and (self.block_size < 1 or self.loop_rule not in ("jacobi",
                                                                                 "same")):
            raise ValueError(f"a loop LatentSpec needs block_size >= 1 and loop_rule 'jacobi' "
                             f"or 'same', got {self.block_size}, {self.loop_rule!r}")
        if self.upstream_eos_from < 0:
            raise ValueError(f"upstream_eos_from must be >= 0, got {self.upstream_eos_from}")
        if not 0 <= self.min_budget <= self.default_budget <= self.max_budget:
            raise ValueError(f"default_budget must be in [{self.min_budget}, "
                             f"max_budget={self.max_budget}], got {self.default_budget}")

    def resolve_budget(self, requested: int | None) -> int:
        """The budget a request runs with. Raises ValueError outside
        ``[min_budget, max_budget]``."""
        budget = self.default_budget if requested is None else requested
        if not self.min_budget <= budget <= self.max_budget:
            raise ValueError(f"latent_budget must be in [{self.min_budget}, {self.max_budget}], "
                             f"got {budget}")
        return budget

    def prompt_extra(self, budget: int) -> int:
        """KV positions a request with (resolved) ``budget`` adds between its prompt and its
        answer: feedback, start ids + ``budget`` latent steps + end ids; loop, start ids +
        the block + end ids (the budget counts passes, not positions); recurrent depth and
        compression heads, 0 (a head's latent steps count against ``max_tokens``)."""
        if self.kind == "feedback":
            return len(self.start_ids) + budget + len(self.end_ids)
        if self.kind == "loop":
            return len(self.start_ids) + self.block_size + len(self.end_ids)
        return 0


def cap_budget(spec: LatentSpec | None, cap: int | None) -> LatentSpec | None:
    """The served spec under a server cap on the latent budget (``EngineConfig.
    max_latent_budget``; None: the model's own ``max_budget``). The default budget is lowered
    to the cap when above it. KV banks stay sized by the model.

    Raises:
        ValueError: naming ``max_latent_budget`` when the model has no budget (a plain model
            or a compression head, whose cap is ``max_latent``) or the cap is outside
            ``[max(min_budget, 1), max_budget]``.
    """
    if cap is None:
        return spec
    if spec is None or spec.kind == "head":
        what = "a plain model" if spec is None else "a compression head (use max_latent)"
        raise ValueError(f"max_latent_budget applies to feedback and recurrent-depth models, "
                         f"not {what}")
    lo = max(spec.min_budget, 1)
    if not lo <= cap <= spec.max_budget:
        raise ValueError(f"max_latent_budget must be in [{lo}, {spec.max_budget}] for this "
                         f"model, got {cap}")
    return replace(spec, max_budget=cap, default_budget=min(spec.default_budget, cap))


def finite_positive(value) -> bool:
    """Whether a config value is a number (not a bool) in (0, inf): NaN and infinities are
    refused (a NaN LoRA scale or LayerNorm eps would load as NaN weights)."""
    import math

    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 < value < math.inf)
