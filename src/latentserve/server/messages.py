"""Messages between the API and engine processes: small dataclasses, pickled (both ends are
local processes of one install)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from latentserve.outputs import StepOutput
from latentserve.sampling_params import SamplingParams

# --- API process -> engine process -----------------------------------------------------


@dataclass(slots=True)
class AddRequest:
    """Queue a request (``RequestFailed`` if the engine rejects it)."""

    rid: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class Abort:
    """Stop a request; the engine answers with a final output whose reason is ``"abort"``."""

    rid: str


@dataclass(slots=True)
class Shutdown:
    """Leave the engine loop and exit."""


@dataclass(slots=True)
class Query:
    """Ask, queueing nothing, for the engine's stats (``check`` None) or whether it would
    accept ``check``; answered by an ``Answer`` with the same ``key``."""

    key: str | int
    check: AddRequest | None = None


# --- engine process -> API process -----------------------------------------------------


@dataclass(slots=True)
class Ready:
    """Sent once the model is loaded and warmed up: what the API process needs."""

    model_name: str
    max_model_len: int
    vocab_size: int | None
    tokenizer: Any  # the engine's transformers tokenizer, pickled along
    latent_spec: Any = None  # the model's LatentSpec (a small frozen dataclass) or None
    sampling_defaults: dict | None = None  # LLMEngine.sampling_defaults (generation config)


@dataclass(slots=True)
class StartupFailed:
    """Sent instead of ``Ready`` when the engine could not start."""

    error: str  # "ExceptionType: message"
    traceback: str = ""


@dataclass(slots=True)
class StepOutputs:
    """One ``LLMEngine.step()``'s outputs; ``scheduled``: ``(queued_at, scheduled_at)``
    monotonic seconds of each request first scheduled since the last message."""

    outputs: list[StepOutput] = field(default_factory=list)
    scheduled: dict[str, tuple[float, float]] = field(default_factory=dict)


@dataclass(slots=True)
class RequestFailed:
    """The engine rejected a request, or failed it while running (``internal``)."""

    rid: str
    error: str
    internal: bool = False


@dataclass(slots=True)
class Answer:
    """Reply to a ``Query``: ``stats`` (``LLMEngine.stats()``, a dict of ints) or, for a check,
    the engine's ``error`` (None: it would accept the request)."""

    key: str | int
    stats: dict[str, int] | None = None
    error: str | None = None


@dataclass(slots=True)
class EngineFailed:
    """The engine loop crashed; the process exits after sending this."""

    error: str

