"""``POST /v1/messages``: the Anthropic Messages API over the same engine.

Served: ``system`` (string or text blocks), user/assistant messages with string or text-block
content (a final assistant message is continued, Anthropic's "prefill"), ``max_tokens``,
``stop_sequences``, ``temperature`` (0..1), ``top_p``, ``top_k``, ``stream``, ``metadata``
(ignored), ``thinking`` (a compression head's switch; "enabled" needs a head) and the latent
body fields of the OpenAI routes, ``return_latent_trace`` included (a model that has no trace
refuses it with a 400 naming it). Refused with a 400: tools, structured outputs
(``output_config.format``) and non-text content blocks. A request with latent work has the
OpenAI choices' ``latent`` object as an extra field of the message (streaming: of the
``message_delta`` event). Newer SDKs have no ``temperature``
/ ``top_p`` / ``top_k`` arguments; clients send them in the body (``extra_body``).

Streaming follows the protocol's event sequence: ``message_start``, ``content_block_start``
(one text block, index 0), ``ping``, ``content_block_delta`` (``text_delta``) per text
fragment, ``content_block_stop``, ``message_delta`` (``stop_reason``, ``stop_sequence``,
``usage.output_tokens``), ``message_stop``; an error after the start is one ``error`` event.
Errors use Anthropic's shape (``latentserve.server.errors``).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from latentserve.sampling_params import SamplingParams
from latentserve.server.errors import APIError, anthropic_error_body, param_from_value_error
from latentserve.server.generation import EngineRequest, TextDelta
from latentserve.server.params import (
    check_stop_count,
    context_error,
    exit_fields,
    head_controls,
    latent_budget,
    latent_positions,
    refuse_head_controls,
    refuse_stream_steps,
    unset_default,
)
from latentserve.server.prompts import render_chat
from latentserve.server.protocol import LatentFields, RequestModel
from latentserve.server.request_ids import new_request_id
from latentserve.server.state import ServerState


class TextBlock(RequestModel):
    type: str
    text: str | None = None


class AnthropicMessage(RequestModel):
    role: str
    content: str | list[TextBlock]


class MessagesRequest(LatentFields):
    model: str
    max_tokens: int
    messages: list[AnthropicMessage]
    system: str | list[TextBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None
    # Anthropic's extended-thinking switch: {"type": "enabled", "budget_tokens": N} or
    # {"type": "disabled"}; on a compression-head model it turns the latent phase on or off.
    thinking: dict[str, Any] | None = None
    # As on the OpenAI routes: the message's ``latent`` gets ``trace`` and ``recurrence``.
    return_latent_trace: bool | None = False


def thinking_flag(thinking: dict | None) -> bool | None:
    """Anthropic's ``thinking`` object as the head's ``thinking`` control: ``enabled`` ->
    True, ``disabled`` -> False, absent -> None (``budget_tokens`` counts text thinking
    tokens, which a latent head does not produce, so it is not used). Raises APIError naming
    ``thinking.type`` for another type."""
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in ("enabled", "disabled"):
        raise APIError(f"thinking.type must be 'enabled' or 'disabled', got {kind!r}",
                       param="thinking.type")
    return kind == "enabled"


class CountTokensRequest(MessagesRequest):
    """``/v1/messages/count_tokens``: a Messages request without ``max_tokens``."""

    max_tokens: int | None = None


_UNSUPPORTED = {"tools": (None, []), "tool_choice": (None,)}

_STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "abort": "end_turn"}


def _blocks_text(content: str | list[TextBlock], param: str) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for j, block in enumerate(content):
        if block.type != "text" or block.text is None:
            raise APIError(f"only text content blocks are supported, got type "
                           f"{block.type!r}", param=f"{param}.{j}")
        parts.append(block.text)
    return "".join(parts)


def _conversation(body: MessagesRequest) -> list[dict[str, str]]:
    if not body.messages:
        raise APIError("messages: at least one message is required", param="messages")
    conversation = []
    if body.system:
        conversation.append({"role": "system", "content": _blocks_text(body.system, "system")})
    for i, message in enumerate(body.messages):
        if message.role not in ("user", "assistant"):
            raise APIError(f"messages.{i}.role: Input should be 'user' or 'assistant', got "
                           f"{message.role!r}", param=f"messages.{i}.role")
        conversation.append({"role": message.role,
                             "content": _blocks_text(message.content, f"messages.{i}.content")})
    if not any(m["role"] == "user" for m in conversation):
        raise APIError("messages: at least one message must have role 'user'",
                       param="messages")
    return conversation


def _check(body: MessagesRequest, state: ServerState) -> None:
    for name, value in (body.model_extra or {}).items():
        if name in _UNSUPPORTED and value not in _UNSUPPORTED[name]:
            raise APIError(f"{name}: not supported by this server", param=name)
    output_config = (body.model_extra or {}).get("output_config")
    if isinstance(output_config, dict) and output_config.get("format") is not None:
        raise APIError("output_config.format: structured outputs are not supported by this "
                       "server", param="output_config.format")
    if body.model != state.model_name:
        raise APIError(f"model: {body.model} (this server serves {state.model_name})",
                       status_code=404, param="model", code="model_not_found")
    if body.temperature is not None and not 0.0 <= body.temperature <= 1.0:
        raise APIError(f"temperature: must be in [0, 1], got {body.temperature}",
                       param="temperature")
    check_stop_count(body.stop_sequences, "stop_sequences", state.limits)


def _params(body: MessagesRequest, num_prompt_tokens: int, max_model_len: int,
            budget: int | None = None, latent: int = 0,
            defaults: dict | None = None) -> SamplingParams:
    """``latent``: KV positions the model adds before the answer
    (``params.latent_positions``); they count against the context like prompt tokens.
    ``defaults``: the model's generation-config sampling defaults (``ServerState.
    sampling_defaults``) for ``temperature``, ``top_p`` and ``top_k`` left unset."""
    if body.max_tokens < 1:
        raise APIError(f"max_tokens: must be at least 1, got {body.max_tokens}",
                       param="max_tokens")
    if num_prompt_tokens >= max_model_len:
        raise context_error(num_prompt_tokens, max_model_len, "messages")
    if num_prompt_tokens + latent + body.max_tokens > max_model_len:
        extra = f" + {latent} latent and transition positions" if latent else ""
        raise APIError(f"prompt is too long: {num_prompt_tokens} tokens{extra} + max_tokens "
                       f"{body.max_tokens} > the maximum context length {max_model_len}",
                       param="max_tokens", code="context_length_exceeded")
    try:
        return SamplingParams(
            max_tokens=body.max_tokens,
            temperature=unset_default(body.temperature, "temperature", defaults, 1.0),
            top_p=unset_default(body.top_p, "top_p", defaults, 1.0),
            top_k=unset_default(body.top_k, "top_k", defaults, -1) or -1,
            stop=list(body.stop_sequences or []),
            latent_budget=budget,
            return_latent_trace=bool(body.return_latent_trace),
            upstream_stop_rules=body.upstream_stop_rules,
            **exit_fields(body))
    except ValueError as exc:
        raise APIError(str(exc), param=param_from_value_error(str(exc))) from None


def _stop(finish_reason: str | None, stop_string: str | None) -> tuple[str, str | None]:
    if stop_string is not None:
        return "stop_sequence", stop_string
    return _STOP_REASONS.get(finish_reason or "stop", "end_turn"), None


def _head_controls(body: MessagesRequest, request, state: ServerState
                   ) -> tuple[MessagesRequest, dict]:
    """The body with its ``thinking`` object as the head's boolean control, and the
    compression-head controls (headers ``x-latent-*`` / ``x-ds4-*`` > body). Raises
    APIError (400 naming the header or field) for a malformed control, or one a model
    without a head would ignore."""
    # No head: "disabled" is a no-op, as for any Anthropic client; "enabled" asks for a
    # head and is refused below.
    flag = thinking_flag(body.thinking)
    has_head = state.latent_spec is not None and state.latent_spec.kind == "head"
    body = body.model_copy(update={"thinking": flag if flag or has_head else None})
    controls = head_controls(request, body)
    refuse_head_controls(request, body, controls, state.latent_spec)
    refuse_stream_steps(request, body, state.latent_spec)  # validates the header (no ticks)
    return body, controls


async def count_input_tokens(body: CountTokensRequest, request, state: ServerState) -> int:
    """``/v1/messages/count_tokens``: the prompt tokens ``/v1/messages`` would take for
    ``body``, after every check ``/v1/messages`` makes, the engine's included
    (``LLMEngine.check_request``, nothing queued), so a body that count accepts is not
    refused later for them. Without ``max_tokens`` (Anthropic's count takes none) the
    context check asks room for one answer token, so ``/v1/messages`` can still refuse a
    larger ``max_tokens``; any model name counts (the route's ``served.resolve`` picks the
    model).

    Raises:
        APIError: 400 for any body ``/v1/messages`` refuses (the engine's reason for its
            refusals), 503 when the engine is gone.
    """
    from latentserve.server.serving import ENGINE_ERRORS, api_error

    _check(body.model_copy(update={"model": state.model_name}), state)
    conversation = _conversation(body)
    prompt_ids = await asyncio.to_thread(
        render_chat, state.tokenizer, conversation,
        continue_final_message=conversation[-1]["role"] == "assistant")
    sized = body.model_copy(update={"max_tokens": body.max_tokens or 1})
    try:
        _, params = _request_params(sized, request, state, len(prompt_ids))
    except APIError as e:
        if e.code != "context_length_exceeded" or body.max_tokens is not None:
            raise
        raise APIError(f"prompt is too long: {len(prompt_ids)} tokens leave no room for an "
                       f"answer token (latent and transition positions counted) within the "
                       f"maximum context length {state.max_model_len}", param="messages",
                       code="context_length_exceeded") from None
    try:
        await state.client.check(uuid.uuid4().hex, prompt_ids, params)
    except ENGINE_ERRORS as exc:
        raise api_error(exc) from None
    return len(prompt_ids)


def _request_params(body: MessagesRequest, request, state: ServerState,
                    num_prompt_tokens: int) -> tuple[MessagesRequest, SamplingParams]:
    """The body with its ``thinking`` resolved and the engine's ``SamplingParams``: body
    fields, ``x-latent-budget``, then the ``x-latent-*`` / ``x-ds4-*`` head controls.
    Raises APIError (400 naming the field or header)."""
    budget = latent_budget(request, body, state.latent_spec)
    params = _params(body, num_prompt_tokens, state.max_model_len, budget,
                     latent_positions(state.latent_spec, budget), state.sampling_defaults)
    body, controls = _head_controls(body, request, state)
    head = {k: v for k, v in controls.items() if v is not None}
    if head:  # x-latent-* / x-ds4-* headers (the seed's only control on /v1/messages)
        import dataclasses

        try:
            params = dataclasses.replace(params, **head)
        except ValueError as exc:  # a body control out of range (the headers are checked)
            raise APIError(str(exc), param=param_from_value_error(str(exc))) from None
    return body, params


async def create_message(body: MessagesRequest, request, state: ServerState):
    """Validate, template, run; answer with one ``message`` object or an SSE event stream.

    Raises:
        APIError: 400 (bad field, context too long, unsupported feature), 404 (another
            model's name), or the engine errors of ``serving.api_error``.
    """
    from latentserve.server.serving import (
        collect,
        latent_info,
        sse_events,
        sse_response,
        start_stream,
    )

    arrival = time.monotonic()
    _check(body, state)
    conversation = _conversation(body)
    prompt_ids = await asyncio.to_thread(  # off the event loop: large prompts take seconds
        render_chat, state.tokenizer, conversation,
        continue_final_message=conversation[-1]["role"] == "assistant")
    body, params = _request_params(body, request, state, len(prompt_ids))
    msg_id, engine_rid = new_request_id(request, "msg")
    if msg_id == engine_rid:
        msg_id = engine_rid = "msg_" + engine_rid.removeprefix("msg-")
    reqs = [EngineRequest(0, engine_rid, prompt_ids, params)]
    asked = bool(body.return_latent_trace)
    if body.stream:
        deltas = await start_stream(request, state, reqs, arrival)
        events = _events(msg_id, state.model_name, len(prompt_ids), deltas, asked)
        return sse_response(sse_events(
            request, state, reqs, events, error_event=_error_event,
            internal_error_event=_event("error", anthropic_error_body(
                "Internal server error", 500)), done=None))
    result = (await collect(request, state, reqs, arrival))[0]
    stop_reason, stop_sequence = _stop(result.finish_reason, result.stop_string)
    msg = _message(msg_id, state.model_name, [{"type": "text", "text": result.text}],
                   stop_reason, stop_sequence, len(prompt_ids), result.num_output_tokens)
    return _with_latent(msg, latent_info(result, asked))


def _with_latent(obj: dict, info) -> dict:
    """``obj`` with the extension field ``latent`` (as on the OpenAI routes' choices: steps,
    trace, compression-head stats, recurrence) when the request has any; Anthropic clients
    ignore fields they do not know."""
    if info is not None:
        obj["latent"] = info.model_dump(exclude_none=True)
    return obj


def _message(msg_id: str, model: str, content: list, stop_reason: str | None,
             stop_sequence: str | None, input_tokens: int, output_tokens: int) -> dict:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


def _event(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


def _error_event(exc: Exception) -> str:
    from latentserve.server.serving import api_error

    err = api_error(exc)
    return _event("error", anthropic_error_body(err.message, err.status_code))


async def _events(msg_id: str, model: str, input_tokens: int,
                  deltas: AsyncIterator[tuple[int, TextDelta]],
                  asked: bool = False) -> AsyncIterator[str]:
    from latentserve.server.serving import latent_info

    yield _event("message_start", {"type": "message_start", "message": _message(
        msg_id, model, [], None, None, input_tokens, 0)})
    yield _event("content_block_start", {"type": "content_block_start", "index": 0,
                                         "content_block": {"type": "text", "text": ""}})
    yield _event("ping", {"type": "ping"})
    last = None
    async for _, delta in deltas:
        if delta.text:
            yield _event("content_block_delta", {
                "type": "content_block_delta", "index": 0,
                "delta": {"type": "text_delta", "text": delta.text}})
        last = delta
    stop_reason, stop_sequence = _stop(last.finish_reason, last.stop_string)
    yield _event("content_block_stop", {"type": "content_block_stop", "index": 0})
    yield _event("message_delta", _with_latent({
        "type": "message_delta",
        "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
        "usage": {"output_tokens": last.num_output_tokens}}, latent_info(last, asked)))
    yield _event("message_stop", {"type": "message_stop"})
