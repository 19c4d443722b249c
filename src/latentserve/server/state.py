"""What the API process knows about the engine it serves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from latentserve.server.client import EngineClient


@dataclass(slots=True)
class ServerState:
    """Shared by all handlers (``app.state.server``)."""

    client: EngineClient
    tokenizer: Any
    model_name: str
    max_model_len: int
    vocab_size: int | None = None
