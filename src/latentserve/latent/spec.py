"""What a latent-reasoning model declares to the engine: ``LatentSpec`` (plain models: none)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

# How CoLaR's stage 1 forms a latent from a group of step-token embeddings
# (``train.colar.compress_groups``); colar_config.json records which.
COMPRESSIONS = ("sqrt_mean", "ramp")
# Per-request controls of the head family (``SamplingParams`` fields); each head takes a
# subset (``LatentSpec.controls``) and a request setting another one is refused (ValueError),
# as is any of them but ``thinking`` (also the chat template's switch) on another model.
HEAD_FIELDS = ("thinking", "max_latent", "min_latent", "use_stop", "stop_threshold",
               "min_output_tokens", "compression_factor", "latent_temperature")


@dataclass(frozen=True, slots=True)
class LatentSpec:
    """A model's latent-reasoning contract.

    Attributes:
        kind: ``"feedback"`` (COCONUT, CODI, SIM-CoT: the last hidden is the next input),
            ``"recurrent"`` (Huginn, Ouro: the budget is recurrences per token), ``"head"``
            (compression head; controls in ``head.HeadSettings``) or ``"loop"`` (PCCoT, LOTUS).
        family: the upstream family name (``"coconut"``, ``"codi"``, ``"huginn"``, ...).
        default_budget / min_budget / max_budget: latent steps (recurrent: recurrences) when
            a request does not say, and the range it may ask for (recurrent: sizes KV banks).
        default_exit: recurrent only: the ``ExitRule`` when a request names none, or None.
        start_ids / end_ids: ids appended before the latent phase / forced after it.
        latent_id: the id recorded at latent positions (never embedded).
        suppress_ids: ids never sampled (logits -inf), e.g. CODI's ``eot``.
        block_size: loop only: latent positions in the block (PCCoT ``num_latent_tokens``).
        loop_rule: loop only: ``"jacobi"`` (block position j reads j-1's output) or
            ``"same"`` (its own).
        controls: head only: the ``HEAD_FIELDS`` the head takes; others are refused.
        max_compression_factor: CoLaR only: the largest compression factor; else 0.
        default_max_latent: CoLaR only: the latent-step cap of a request that sends none
            (``colar_config.json`` ``max_latent``); else 0.
        upstream_eos_from: with ``upstream_stop_rules``, an EOS ends the request only from
            answer token number ``upstream_eos_from`` (1-based); 0: the rule is refused.
    """

    kind: str
    family: str
    default_budget: int
    max_budget: int = 64
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
    default_max_latent: int = 0
    upstream_eos_from: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("feedback", "recurrent", "head", "loop"):
            raise ValueError(f"LatentSpec.kind must be 'feedback', 'recurrent', 'head' or "
                             f"'loop', got {self.kind!r}")
        if not 0 <= self.min_budget <= self.default_budget <= self.max_budget:
            raise ValueError(f"default_budget must be in [{self.min_budget}, "
                             f"max_budget={self.max_budget}], got {self.default_budget}")

    def resolve_budget(self, requested: int | None) -> int:
        """The budget a request runs with; ValueError outside ``[min_budget, max_budget]``."""
        budget = self.default_budget if requested is None else requested
        if not self.min_budget <= budget <= self.max_budget:
            raise ValueError(f"latent_budget must be in [{self.min_budget}, {self.max_budget}], "
                             f"got {budget}")
        return budget

    def prompt_extra(self, budget: int) -> int:
        """KV positions a request with ``budget`` adds between its prompt and its answer."""
        if self.kind == "feedback":
            return len(self.start_ids) + budget + len(self.end_ids)
        if self.kind == "loop":
            return len(self.start_ids) + self.block_size + len(self.end_ids)
        return 0


def cap_budget(spec: LatentSpec | None, cap: int | None) -> LatentSpec | None:
    """The served spec under ``EngineConfig.max_latent_budget`` (None: no cap); the default
    is lowered to the cap. Raises ValueError naming ``max_latent_budget`` for a model without
    a budget or a cap outside ``[max(min_budget, 1), max_budget]``."""
    if cap is None:
        return spec
    if spec is None or spec.kind == "head":
        what = ("a plain model" if spec is None else "a compression head (a request's "
                "max_latent caps its steps, and the context always does)")
        raise ValueError(f"max_latent_budget applies to feedback, looped-block and "
                         f"recurrent-depth models, not {what}")
    lo = max(spec.min_budget, 1)
    if not lo <= cap <= spec.max_budget:
        raise ValueError(f"max_latent_budget must be in [{lo}, {spec.max_budget}] for this "
                         f"model, got {cap}")
    return replace(spec, max_budget=cap, default_budget=min(spec.default_budget, cap))


def finite_positive(value) -> bool:
    """Whether a config value is a number (not a bool) in (0, inf), NaN refused."""
    import math

    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and 0 < value < math.inf)
