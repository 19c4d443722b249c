"""What a latent-reasoning model declares to the engine: ``LatentSpec``.

A plain model declares none and nothing changes for it. The engine reads only these fields;
each family's own mechanics (the feedback projection, head modules, ...) stay in the model.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LatentSpec:
    """A model's latent-reasoning contract.

    Attributes:
        kind: ``"feedback"`` (COCONUT, CODI, SIM-CoT: the last hidden, maybe projected, is the
            next input embedding).
        family: the upstream family name (``"coconut"``, ``"codi"``), for logs and docs.
        default_budget: latent steps when a request does not say (``latent_budget=None``).
        max_budget: the largest budget a request may ask for (the server's cap).
        positions_per_thought: KV positions one latent step writes (1 for feedback latents).
        start_ids: token ids appended to every prompt before the latent phase (COCONUT
            ``<|start-latent|>``; CODI ``bot``). Part of the prompt for caching.
        end_ids: token ids forced after the latent phase, before the answer (COCONUT
            ``<|end-latent|>``; CODI ``eot``).
        latent_id: the id recorded at latent positions (COCONUT ``<|latent|>``); it never
            reaches the embedding lookup because those rows are replaced.
        suppress_ids: ids never sampled (their logits are set to -inf), e.g. CODI's ``eot``,
            which upstream drops from the answer's argmax.
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

    def __post_init__(self) -> None:
        if self.kind not in ("feedback",):
            raise ValueError(f"LatentSpec.kind must be 'feedback', got {self.kind!r}")
        if not 0 <= self.default_budget <= self.max_budget:
            raise ValueError(f"default_budget must be in [0, max_budget={self.max_budget}], "
                             f"got {self.default_budget}")

    def resolve_budget(self, requested: int | None) -> int:
        """The budget a request runs with. Raises ValueError above ``max_budget``."""
        budget = self.default_budget if requested is None else requested
        if budget > self.max_budget:
            raise ValueError(f"latent_budget must be in [0, {self.max_budget}], got {budget}")
        return budget
