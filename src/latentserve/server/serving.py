"""A client request's engine requests collected or streamed as SSE, engine errors turned
into API errors, all aborted when the HTTP client disconnects."""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, field

from pydantic_core import to_json

from latentserve.server.client import (
    EngineDeadError,
    EngineInternalError,
    EngineQueueTimeout,
    EngineRequestError,
)
from latentserve.server.errors import APIError, is_anthropic_path, param_from_value_error
from latentserve.server.generation import EngineRequest, TextDelta, generate_text, merge
from latentserve.server.latent_params import header_error
from latentserve.server.metrics import RequestGroup

log = logging.getLogger(__name__)

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
ENGINE_ERRORS = (EngineRequestError, EngineInternalError, EngineDeadError, EngineQueueTimeout)


def api_error(exc: Exception, request=None) -> APIError:
    """The API error of an engine failure: rejected 400 (one about the prompt names
    ``messages`` on the chat routes of ``request``, one about a head control a header of
    ``request`` set names that header), internal 500, dead 503, queue timeout 503
    ``overloaded``."""
    if isinstance(exc, EngineRequestError):
        message = str(exc)
        code = "context_length_exceeded" if "max_model_len" in message else None
        path = getattr(getattr(request, "url", None), "path", "")
        chat = path.endswith("/chat/completions") or is_anthropic_path(path)
        prompt = "messages" if chat else "prompt"
        if message.startswith("prompt"):
            return APIError(message, param=prompt, code=code)
        return header_error(request, message, param_from_value_error(message), code)
    if isinstance(exc, EngineQueueTimeout):
        return overloaded(str(exc))
    status, code = (500, "engine_error") if isinstance(exc, EngineInternalError) else \
        (503, "engine_dead")  # EngineDeadError
    return APIError(str(exc), status_code=status, type="server_error", code=code)


@dataclass(slots=True)
class ChoiceResult(TextDelta):
    """One engine request's deltas folded in, with the ticks' trace entries."""

    step_trace: list = field(default_factory=list)

    def add(self, delta: TextDelta) -> None:
        """Fold one delta of this choice in."""
        self.text += delta.text
        self.logprobs.extend(delta.logprobs)
        self.token_ids.extend(delta.token_ids)
        self.num_output_tokens = delta.num_output_tokens
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.latent_tick and delta.latent_trace:
            self.step_trace.extend(delta.latent_trace)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_string = delta.finish_reason, delta.stop_string
            self.latent_steps, self.latent_trace = delta.latent_steps, delta.latent_trace
            self.latent_stats, self.recurrence = delta.latent_stats, delta.recurrence


@asynccontextmanager
async def _abort_on_disconnect(request, state, reqs: list[EngineRequest]):
    """Abort ``reqs`` if the HTTP client disconnects while the block runs; yields a list that
    holds True once it has (a later watcher of the same requests then aborts nothing)."""
    seen: list[bool] = []

    async def watch() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass
        seen.append(True)
        for r in reqs:
            state.client.abort(r.rid)

    task = asyncio.create_task(watch())
    try:
        yield seen
    finally:
        task.cancel()


RETRY_AFTER_S = 1  # what an overloaded server asks a client to wait, seconds


def overloaded(message: str) -> APIError:
    """The 503 ``overloaded`` error with ``Retry-After`` (529 under ``/v1/messages``)."""
    return APIError(message, status_code=503, type="server_error", code="overloaded",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


def _deltas(state, reqs: list[EngineRequest], arrival: float | None, ticket):
    """The merged deltas of ``reqs``; with ``log_requests``, first one INFO line each of its
    prompt and token ids (cut to ``state.max_log_len``) and parameters, as vLLM's
    ``RequestLogger.log_inputs``."""
    cut = state.max_log_len  # None: [:None], all of it
    for r in reqs if state.log_requests else ():
        log.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s", r.rid,
                 r.prompt_text and r.prompt_text[:cut], r.params, r.prompt_ids[:cut])
    # One metrics group per prompt: its n choices (vLLM's parent request).
    groups = ({i: RequestGroup(state.metrics, n)
               for i, n in Counter(r.prompt_index for r in reqs).items()}
              if state.metrics is not None else {})
    return merge([generate_text(state, r.rid, r.prompt_ids, r.params, arrival,
                                groups.get(r.prompt_index), ticket) for r in reqs])


async def collect(request, state, reqs: list[EngineRequest], arrival: float | None = None,
                  ticket=None) -> list[ChoiceResult]:
    """Run the engine requests concurrently; one ``ChoiceResult`` each. APIError."""
    results = [ChoiceResult("", None, 0) for _ in reqs]
    async with _abort_on_disconnect(request, state, reqs), \
            aclosing(_deltas(state, reqs, arrival, ticket)) as deltas:
        try:
            async for i, delta in deltas:
                results[i].add(delta)
        except ENGINE_ERRORS as exc:
            raise api_error(exc, request) from None
    return results


async def stream(request, state, reqs: list[EngineRequest], arrival: float | None, ticket,
                 chunks: Callable[[AsyncIterator[tuple[int, TextDelta]]], AsyncIterator],
                 error_event: Callable[[APIError], str] = (
                     lambda err: f"data: {json.dumps(err.body())}\n\n"),
                 done: str | None = "data: [DONE]\n\n"):
    """The SSE response of ``chunks(deltas)`` (deltas as ``(position in reqs, delta)``; a dict
    chunk as compact JSON, non-finite floats null), then ``done``; a failure mid-stream is one
    ``error_event``. APIError (not a 200 stream) if the engine refuses the first delta."""
    from fastapi.responses import StreamingResponse

    deltas = _deltas(state, reqs, arrival, ticket)
    async with _abort_on_disconnect(request, state, reqs) as gone:
        try:
            first = await anext(deltas)
        except ENGINE_ERRORS as exc:
            await deltas.aclose()
            raise api_error(exc, request) from None

    async def events() -> AsyncIterator[str]:
        body = chunks(_chain(first, deltas))
        async with _abort_on_disconnect(request, state, [] if gone else reqs), aclosing(body):
            try:
                async for chunk in body:
                    yield chunk if isinstance(chunk, str) else \
                        f"data: {to_json(chunk, inf_nan_mode='null').decode()}\n\n"
            except ENGINE_ERRORS as exc:
                yield error_event(api_error(exc, request))
            except Exception:  # noqa: BLE001 - the stream ends with an error event, no trace
                log.exception("stream of %s failed", reqs[0].rid if reqs else "?")
                yield error_event(APIError("Internal server error", status_code=500,
                                           type="server_error"))
        if done is not None:
            yield done

    return StreamingResponse(events(), media_type="text/event-stream", headers=SSE_HEADERS)


async def _chain(first, rest: AsyncIterator) -> AsyncIterator:
    async with aclosing(rest):
        yield first
        async for item in rest:
            yield item
