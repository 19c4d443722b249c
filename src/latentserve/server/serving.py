"""What both endpoints do with a running request: collect it, or stream it as SSE; with
engine errors turned into API errors and an abort when the HTTP client disconnects."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import aclosing
from functools import partial

from pydantic import BaseModel

from latentserve.server.client import EngineClient, EngineDeadError, EngineRequestError
from latentserve.server.disconnect import on_disconnect
from latentserve.server.errors import APIError, error_body
from latentserve.server.generation import TextDelta

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def api_error(exc: Exception) -> APIError:
    """The client-facing error for an engine-side failure."""
    if isinstance(exc, EngineRequestError):
        message = str(exc)
        return APIError(message, param="prompt" if message.startswith("prompt") else None)
    if isinstance(exc, EngineDeadError):
        return APIError(str(exc), status_code=503, type="server_error", code="engine_dead")
    raise TypeError(f"not an engine error: {exc!r}")


async def collect(request, client: EngineClient, rid: str,
                  deltas: AsyncIterator[TextDelta]) -> TextDelta:
    """Run the request to the end; return all its text with the final reason and count."""
    parts: list[str] = []
    last = None
    async with on_disconnect(request, partial(client.abort, rid)), aclosing(deltas):
        try:
            async for delta in deltas:
                parts.append(delta.text)
                last = delta
        except (EngineRequestError, EngineDeadError) as exc:
            raise api_error(exc) from None
    return TextDelta("".join(parts), last.finish_reason, last.num_output_tokens)


async def start_stream(request, client: EngineClient, rid: str,
                       deltas: AsyncIterator[TextDelta]) -> AsyncIterator[TextDelta]:
    """Wait for the first delta, so that a rejected request still gets a plain 400 (not a
    200 stream carrying an error); return an iterator over all deltas."""
    async with on_disconnect(request, partial(client.abort, rid)):
        try:
            first = await anext(deltas)
        except (EngineRequestError, EngineDeadError) as exc:
            await deltas.aclose()
            raise api_error(exc) from None
    return _chain(first, deltas)


async def _chain(first: TextDelta, rest: AsyncIterator[TextDelta]) -> AsyncIterator[TextDelta]:
    async with aclosing(rest):
        yield first
        async for delta in rest:
            yield delta


async def sse_events(request, client: EngineClient, rid: str,
                     chunks: AsyncIterator[BaseModel]) -> AsyncIterator[str]:
    """Server-sent events: ``data: {chunk}`` per chunk, then ``data: [DONE]``.

    An error after the stream started is sent as one ``data: {"error": ...}`` event.
    """
    async with on_disconnect(request, partial(client.abort, rid)), aclosing(chunks):
        try:
            async for chunk in chunks:
                yield f"data: {chunk.model_dump_json()}\n\n"
        except (EngineRequestError, EngineDeadError) as exc:
            yield f"data: {json.dumps(api_error(exc).body())}\n\n"
        except Exception:  # noqa: BLE001 - the stream ends with an error event, no trace
            log.exception("stream %s failed", rid)
            yield f"data: {json.dumps(error_body('Internal server error', 'server_error'))}\n\n"
    yield "data: [DONE]\n\n"


def sse_response(events: AsyncIterator[str]):
    from fastapi.responses import StreamingResponse

    return StreamingResponse(events, media_type="text/event-stream", headers=SSE_HEADERS)
