"""``POST /v1/chat/completions``."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

from latentserve.server.generation import TextDelta, generate_text
from latentserve.server.params import check_common, sampling_params
from latentserve.server.prompts import chat_prompt_ids, check_prompt_length
from latentserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    DeltaMessage,
    Usage,
)
from latentserve.server.serving import collect, sse_events, sse_response, start_stream
from latentserve.server.state import ServerState


async def create_chat_completion(body: ChatCompletionRequest, request, state: ServerState):
    """Validate, template, run; answer with one response or an SSE stream."""
    check_common(body, state.model_name)
    prompt_ids = chat_prompt_ids(state.tokenizer, body.messages)
    check_prompt_length(len(prompt_ids), state.max_model_len, "messages")
    if body.max_completion_tokens is not None:
        max_tokens, field = body.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, field = body.max_tokens, "max_tokens"
    params = sampling_params(body, max_tokens, field, len(prompt_ids), state.max_model_len)
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    deltas = generate_text(state.client, state.tokenizer, rid, prompt_ids, params)
    if body.stream:
        deltas = await start_stream(request, state.client, rid, deltas)
        chunks = _chunks(rid, state.model_name, len(prompt_ids), deltas, body.include_usage)
        return sse_response(sse_events(request, state.client, rid, chunks))
    result = await collect(request, state.client, rid, deltas)
    return ChatCompletionResponse(
        id=rid, model=state.model_name,
        choices=[ChatChoice(message=AssistantMessage(content=result.text),
                            finish_reason=result.finish_reason)],
        usage=Usage.of(len(prompt_ids), result.num_output_tokens),
    )


async def _chunks(rid: str, model: str, num_prompt_tokens: int,
                  deltas: AsyncIterator[TextDelta], include_usage: bool
                  ) -> AsyncIterator[ChatCompletionChunk]:
    """Role chunk, content chunks, one chunk with the finish reason, then (if asked) one
    usage chunk with no choices."""

    def chunk(delta: DeltaMessage, finish_reason: str | None = None) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=rid, model=model, choices=[
            ChatChunkChoice(delta=delta, finish_reason=finish_reason)])

    yield chunk(DeltaMessage(role="assistant", content=""))
    last = None
    async for delta in deltas:
        if delta.text:
            yield chunk(DeltaMessage(content=delta.text))
        last = delta
    yield chunk(DeltaMessage(), last.finish_reason)
    if include_usage:
        yield ChatCompletionChunk(id=rid, model=model, choices=[],
                                  usage=Usage.of(num_prompt_tokens, last.num_output_tokens))
