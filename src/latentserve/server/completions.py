"""``POST /v1/completions``."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from latentserve.server.generation import TextDelta, generate_text
from latentserve.server.params import check_common, sampling_params
from latentserve.server.prompts import check_prompt_length, completion_prompt_ids
from latentserve.server.protocol import (
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
)
from latentserve.server.serving import collect, sse_events, sse_response, start_stream
from latentserve.server.state import ServerState


async def create_completion(body: CompletionRequest, request, state: ServerState):
    """Validate, encode, run; answer with one response or an SSE stream."""
    check_common(body, state.model_name)
    prompt_ids = completion_prompt_ids(state.tokenizer, body.prompt, state.vocab_size)
    check_prompt_length(len(prompt_ids), state.max_model_len, "prompt")
    params = sampling_params(body, body.max_tokens, "max_tokens", len(prompt_ids),
                             state.max_model_len)
    rid = f"cmpl-{uuid.uuid4().hex}"
    deltas = generate_text(state.client, state.tokenizer, rid, prompt_ids, params)
    if body.stream:
        deltas = await start_stream(request, state.client, rid, deltas)
        chunks = _chunks(rid, state.model_name, len(prompt_ids), deltas, body.include_usage)
        return sse_response(sse_events(request, state.client, rid, chunks))
    result = await collect(request, state.client, rid, deltas)
    return CompletionResponse(
        id=rid, model=state.model_name,
        choices=[CompletionChoice(text=result.text, finish_reason=result.finish_reason)],
        usage=Usage.of(len(prompt_ids), result.num_output_tokens),
    )


async def _chunks(rid: str, model: str, num_prompt_tokens: int,
                  deltas: AsyncIterator[TextDelta], include_usage: bool
                  ) -> AsyncIterator[CompletionResponse]:
    """Text chunks, the last one carrying the finish reason, then (if asked) one usage
    chunk with no choices."""
    async for delta in deltas:
        yield CompletionResponse(id=rid, model=model, choices=[
            CompletionChoice(text=delta.text, finish_reason=delta.finish_reason)])
        last = delta
    if include_usage:
        yield CompletionResponse(id=rid, model=model, choices=[],
                                 usage=Usage.of(num_prompt_tokens, last.num_output_tokens))
