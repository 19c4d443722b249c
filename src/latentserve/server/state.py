"""What the API process knows about the engine it serves, and the limits it enforces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from latentserve.server.client import EngineClient

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
# Output tokens one client request may ask for in all: prompts x n x max_tokens.
DEFAULT_MAX_REQUEST_OUTPUT_TOKENS = 1 << 21


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Per-request limits (a request over one gets a 400 naming the field).

    ``max_n``: choices per prompt; ``max_prompts``: prompts in one ``/v1/completions``
    request; ``max_logprobs``: ``top_logprobs`` / completions ``logprobs``;
    ``max_request_body_bytes``: HTTP body size (413 above it);
    ``max_request_output_tokens``: the total work of one request, the sum of ``max_tokens``
    (as resolved: unset means up to the end of the context) over its prompts and ``n``
    choices. ``max_tokens`` and the prompt length are each bounded by the model's context
    (``max_model_len``).

    Raises:
        ValueError: a limit below 1, naming it.
    """

    max_n: int = 16
    max_prompts: int = 256
    max_logprobs: int = 20
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES
    max_request_output_tokens: int = DEFAULT_MAX_REQUEST_OUTPUT_TOKENS

    def __post_init__(self) -> None:
        for name in ("max_n", "max_prompts", "max_logprobs", "max_request_body_bytes",
                     "max_request_output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(slots=True)
class ServerState:
    """Shared by all handlers (``app.state.server``). ``metrics`` is a
    ``latentserve.server.metrics.ServerMetrics`` (None: no metrics are recorded)."""

    client: EngineClient
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    metrics: Any = None
    latent_spec: Any = None  # the served model's LatentSpec, or None for a plain model
