"""What the API process knows about the engine it serves, and the limits it enforces."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from latentserve.server.client import EngineClient

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Per-request limits (a request over one gets a 400 naming the field).

    ``max_n``: choices per prompt; ``max_prompts``: prompts in one ``/v1/completions``
    request; ``max_logprobs``: ``top_logprobs`` / completions ``logprobs``;
    ``max_request_body_bytes``: HTTP body size (413 above it). ``max_tokens`` and the prompt
    length are bounded by the model's context (``max_model_len``).
    """

    max_n: int = 16
    max_prompts: int = 256
    max_logprobs: int = 20
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES


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
