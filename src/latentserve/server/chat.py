"""``POST /v1/chat/completions``."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator

from latentserve.server.errors import APIError
from latentserve.server.generation import EngineRequest, TextDelta
from latentserve.server.logprobs import chat_logprobs, token_texts
from latentserve.server.params import (
    check_common,
    check_logprobs,
    check_total_output,
    engine_max_tokens,
    fan_out,
    head_controls,
    latent_budget,
    latent_positions,
    refuse_head_controls,
    refuse_stream_steps,
    sampling_params,
    stream_latent_steps,
)
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
from latentserve.server.request_ids import new_request_id
from latentserve.server.serving import (
    collect,
    latent_info,
    sse_events,
    sse_response,
    start_stream,
)
from latentserve.server.state import ServerState

# The reasoning_content of one latent-step tick in a stream: a zero-width space, so a client
# shows progress without visible text (the seed's choice; env LATENTSERVE_LATENT_TICK_TEXT).
LATENT_TICK_TEXT = os.environ.get("LATENTSERVE_LATENT_TICK_TEXT", "\u200b")


async def create_chat_completion(body: ChatCompletionRequest, request, state: ServerState):
    """Validate, template, fan out ``n`` engine requests, run; answer with one response or
    an SSE stream (choices interleaved, each with its ``index``)."""
    arrival = time.monotonic()
    body = body.with_template_kwargs_fields()  # what a router leaves of the latent fields
    check_common(body, state.model_name, state.limits)
    logprobs = _logprobs_k(body, state)
    head = head_controls(request, body, body.chat_template_kwargs)
    refuse_head_controls(request, body, head, state.latent_spec)
    refuse_stream_steps(request, body, state.latent_spec)
    ticks = bool(body.stream) and stream_latent_steps(request, body)
    template_kwargs = body.chat_template_kwargs
    if head["thinking"] is not None:  # the template renders the thinking opening (or not)
        template_kwargs = {**(template_kwargs or {}), "thinking": head["thinking"],
                           "enable_thinking": head["thinking"]}
    # Templating and tokenizing a large prompt takes seconds: off the event loop, so other
    # clients' streams keep flowing.
    prompt_ids = await asyncio.to_thread(
        chat_prompt_ids, state.tokenizer, body.messages, body.tools,
        template_kwargs=template_kwargs,
        add_generation_prompt=body.add_generation_prompt is not False,
        continue_final_message=bool(body.continue_final_message))
    check_prompt_length(len(prompt_ids), state.max_model_len, "messages")
    if body.max_completion_tokens is not None:
        max_tokens, field = body.max_completion_tokens, "max_completion_tokens"
    else:
        max_tokens, field = body.max_tokens, "max_tokens"
    budget = latent_budget(request, body, state.latent_spec)
    params = sampling_params(body, max_tokens, field, len(prompt_ids), state.max_model_len,
                             logprobs, budget, head, stream_latent_steps=ticks,
                             latent_positions=latent_positions(state.latent_spec, budget),
                             defaults=state.sampling_defaults)
    check_total_output([engine_max_tokens(params, state.latent_spec, len(prompt_ids),
                                          state.max_model_len)], body.n or 1, field,
                       state.limits, [params.max_tokens])
    rid, engine_rid = new_request_id(request, "chatcmpl")
    reqs = [EngineRequest(i, f"{engine_rid}-{i}", prompt_ids, p)
            for i, p in enumerate(fan_out(params, body.n or 1))]
    as_ids = bool(body.return_tokens_as_token_ids)
    if body.stream:
        deltas = await start_stream(request, state, reqs, arrival)
        chunks = _chunks(state, rid, len(prompt_ids), len(reqs), deltas, body.include_usage,
                         logprobs is not None, as_ids, bool(body.return_latent_trace))
        return sse_response(sse_events(request, state, reqs, chunks))
    results = await collect(request, state, reqs, arrival)
    texts = token_texts(state.tokenizer)
    return ChatCompletionResponse(
        id=rid, model=state.model_name,
        choices=[ChatChoice(index=i, message=AssistantMessage(content=r.text),
                            finish_reason=r.finish_reason,
                            logprobs=(chat_logprobs(texts, r.logprobs, as_ids)
                                      if logprobs is not None else None),
                            latent=r.latent_info(bool(body.return_latent_trace)))
                 for i, r in enumerate(results)],
        usage=Usage.of(len(prompt_ids), sum(r.num_output_tokens for r in results)),
    )


def _logprobs_k(body: ChatCompletionRequest, state: ServerState) -> int | None:
    """``top_logprobs`` when ``logprobs`` is true (0 if unset), else None."""
    if not body.logprobs:
        if body.top_logprobs:
            raise APIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        return None
    k = body.top_logprobs or 0
    check_logprobs(k, "top_logprobs", state.limits)
    return k


async def _chunks(state: ServerState, rid: str, num_prompt_tokens: int, n: int,
                  deltas: AsyncIterator[tuple[int, TextDelta]], include_usage: bool,
                  want_logprobs: bool, as_ids: bool, trace: bool
                  ) -> AsyncIterator[ChatCompletionChunk]:
    """Per choice: a role chunk, content chunks (and, with ``stream_latent_steps``, one
    ``reasoning_content`` chunk of :data:`LATENT_TICK_TEXT` per latent step), one chunk with
    the finish reason and the choice's ``latent`` field (as in the non-streamed response;
    left out when None); then (if asked) one usage chunk with no choices."""
    model = state.model_name
    texts = token_texts(state.tokenizer)

    def chunk(index: int, delta: DeltaMessage, finish_reason: str | None = None,
              lps=None, latent=None) -> ChatCompletionChunk:
        logprobs = chat_logprobs(texts, lps, as_ids) if want_logprobs and lps else None
        return ChatCompletionChunk(id=rid, model=model, choices=[ChatChunkChoice(
            index=index, delta=delta, finish_reason=finish_reason, logprobs=logprobs,
            latent=latent)])

    for i in range(n):
        yield chunk(i, DeltaMessage(role="assistant", content=""))
    tokens = [0] * n
    async for i, delta in deltas:
        tokens[i] = delta.num_output_tokens
        for _ in range(delta.latent_tick):
            yield chunk(i, DeltaMessage(reasoning_content=LATENT_TICK_TEXT))
        if delta.text or delta.logprobs:
            yield chunk(i, DeltaMessage(content=delta.text), None, delta.logprobs)
        if delta.finish_reason is not None:
            yield chunk(i, DeltaMessage(), delta.finish_reason,
                        latent=latent_info(delta, trace))
    if include_usage:
        yield ChatCompletionChunk(id=rid, model=model, choices=[],
                                  usage=Usage.of(num_prompt_tokens, sum(tokens)))
