"""Per-request sampling parameters, shaped like vLLM's ``SamplingParams``."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    """How one request is decoded.

    Fields follow vLLM's names and meanings. ``temperature == 0`` means greedy.
    ``top_k <= 0`` (or -1) disables top-k; ``top_p == 1`` and ``min_p == 0`` disable those.
    ``seed`` makes sampling reproducible per request, independent of the batch it rides in.
    ``stop`` strings are matched on detokenized text and are not part of the output text;
    ``stop_token_ids`` end the request when sampled (the token is kept in ``token_ids``,
    not in the text). ``max_tokens`` counts generated tokens.

    Raises:
        ValueError: naming the field and the allowed range, from ``__post_init__``.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    # Latent reasoning: None = the model's default budget; 0 = no thinking.
    latent_budget: int | None = None
    # Report each latent step's norm and logit-lens top-5 tokens on the final output.
    return_latent_trace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        _check_int("max_tokens", self.max_tokens, lo=1)
        _check_num("temperature", self.temperature, lo=0.0)
        _check_num("top_p", self.top_p, lo=0.0, hi=1.0, lo_open=True)
        _check_int("top_k", self.top_k, lo=-1)
        _check_num("min_p", self.min_p, lo=0.0, hi=1.0)
        if self.seed is not None:
            _check_int("seed", self.seed, lo=0, hi=2**63 - 1)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must be a list of non-empty strings, got {s!r}")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids[]", t, lo=0)
        if self.latent_budget is not None:
            _check_int("latent_budget", self.latent_budget, lo=0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_int(name: str, value: object, lo: int | None = None, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    _check_range(name, value, lo, hi)


def _check_num(
    name: str, value: object, lo: float | None = None, hi: float | None = None, lo_open=False
) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if lo_open and lo is not None and value <= lo:
        raise ValueError(f"{name} must be in ({lo}, {hi}], got {value}")
    _check_range(name, value, lo, hi)


def _check_range(name: str, value, lo, hi) -> None:
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        lo_s = "-inf" if lo is None else lo
        hi_s = "inf" if hi is None else hi
        raise ValueError(f"{name} must be in [{lo_s}, {hi_s}], got {value}")
