"""What the API process knows about the engines it serves (one :class:`ServerState` per
model, gathered in :class:`ServedModels`), and the limits it enforces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from latentserve.options import check, option
from latentserve.server.client import EngineClient
from latentserve.server.errors import APIError

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
# Output tokens one client request may ask for in all: prompts x n x max_tokens.
DEFAULT_MAX_REQUEST_OUTPUT_TOKENS = 1 << 21


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Per-request limits (``ServerOptions`` says what each bounds; None: no limit).
    ValueError naming a limit out of its range."""

    max_n: int = option(16, ge=1)
    max_prompts: int = option(256, ge=1)
    max_logprobs: int | None = option(20, ge=0)  # EngineConfig.max_logprobs; None: the engine's
    max_request_body_bytes: int = option(DEFAULT_MAX_REQUEST_BODY_BYTES, ge=1)
    max_request_output_tokens: int = option(DEFAULT_MAX_REQUEST_OUTPUT_TOKENS, ge=1)
    max_stop: int = option(64, ge=1)
    max_waiting_requests: int | None = option(None, ge=0)
    queue_timeout: float | None = option(None, gt=0)

    def __post_init__(self) -> None:
        check(self)


@dataclass(slots=True)
class ServerState:
    """One served model as the handlers see it; ``model_name`` is the name responses carry,
    ``aliases`` the other names a request may use, ``root`` the model path."""

    client: EngineClient
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    metrics: Any = None
    latent_spec: Any = None  # the served model's LatentSpec, or None for a plain model
    max_num_seqs: int | None = None  # the engine's seats (for max_waiting_requests)
    aliases: tuple[str, ...] = ()
    root: str | None = None
    log_requests: bool = False
    max_log_len: int | None = None
    sampling_defaults: dict = field(default_factory=dict)
    tool_parser: str | None = None
    reasoning_parser: str | None = None
    trust_request_chat_template: bool = False
    reserved: int = 0  # engine requests admitted and not yet sent (admission.Ticket)


class ServedModels:
    """The served models (``states``, in order) by every name they are served as; ValueError
    for none or a name served twice."""

    def __init__(self, states: ServerState | list[ServerState]):
        self.states = [states] if isinstance(states, ServerState) else list(states)
        if not self.states:
            raise ValueError("a server needs at least one model")
        self.by_name: dict[str, ServerState] = {}  # aliases too
        for s in self.states:
            for name in (s.model_name, *s.aliases):
                if name in self.by_name:
                    raise ValueError(f"two models are served as {name!r}")
                self.by_name[name] = s

    def canonical(self, model: str | None) -> str | None:
        """The ``model_name`` of the model served as ``model``; other values unchanged."""
        state = self.by_name.get(model)  # None for None
        return model if state is None else state.model_name

    def resolve(self, model: str | None) -> ServerState:
        """The state serving ``model`` (with one model, that one). APIError: 400 for None
        with several models, 404 ``model_not_found`` for a name not served."""
        if len(self.states) == 1:
            return self.states[0]
        served = ", ".join(repr(s.model_name) for s in self.states)
        if model is None:
            raise APIError(f"Missing required parameter: 'model' (this server serves "
                           f"several models: {served})", param="model",
                           code="missing_required_parameter")
        state = self.by_name.get(model)
        if state is None:
            raise APIError(f"The model '{model}' does not exist; this server serves "
                           f"{served}", status_code=404, param="model",
                           code="model_not_found")
        return state
