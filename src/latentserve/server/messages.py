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
    """Queue a request; ``check_only``: only check it (``RequestChecked`` or ``RequestFailed``)."""

    rid: str
    prompt_token_ids: list[int]
    params: SamplingParams
    check_only: bool = False


@dataclass(slots=True)
class Abort:
    """Stop a request; the engine answers with a final output whose reason is ``"abort"``."""

    rid: str


@dataclass(slots=True)
class Shutdown:
    """Leave the engine loop and exit."""


@dataclass(slots=True)
class GetStats:
    """Ask for an ``EngineStats`` reply carrying the same ``token``."""

    token: int


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
class RequestChecked:
    """Reply to an ``AddRequest`` with ``check_only``: the engine would accept it."""

    rid: str


@dataclass(slots=True)
class EngineStats:
    """Reply to ``GetStats``: ``LLMEngine.stats()`` (a dict of ints; no tensors)."""

    token: int
    stats: dict[str, int]


@dataclass(slots=True)
class EngineFailed:
    """The engine loop crashed; the process exits after sending this."""

    error: str

