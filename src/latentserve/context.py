"""A tiny global forward context, so model files read like the Hugging Face reference they
mirror: the model runner sets it before ``model.forward`` and attention layers read it
(the nano-vllm pattern, ``nanovllm/utils/context.py``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class ForwardContext:
    """State of the current forward pass: ``attn_meta``, ``backend``, ``kv_pool``;
    ``capture_layer >= 0``: the residual stream after that many layers is copied into
    ``capture_buf[:T]`` (fixed, graph-capturable; compression heads read it), then
    ``on_capture(capture_buf[:T])`` when set (a decode graph starts the head there). Recurrent
    models: ``depths [T] int64`` recurrence counts and ``recurrent`` (``RecurrentBatch``)."""

    attn_meta: Any
    backend: Any
    kv_pool: Any
    capture_layer: int = -1
    capture_buf: Any = None
    depths: Any = None
    recurrent: Any = None
    on_capture: Any = None

    def maybe_capture(self, layer: int, x) -> None:
        """Called by the model after decoder layer ``layer - 1`` (``layer`` layers done)."""
        if layer == self.capture_layer:
            self.capture_buf[: x.shape[0]].copy_(x)
            if self.on_capture is not None:
                self.on_capture(self.capture_buf[: x.shape[0]])


_CTX: ForwardContext | None = None


def set_context(ctx: ForwardContext | None) -> None:
    global _CTX
    _CTX = ctx


def get_context() -> ForwardContext:
    if _CTX is None:
        raise RuntimeError("no forward context: call set_context() before model.forward()")
    return _CTX
