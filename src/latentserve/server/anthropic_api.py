"""``POST /v1/messages``: the Anthropic Messages API over the same engine.
Design notes: docs/internals.md, "latentserve.server.anthropic_api"."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import ConfigDict, Field

from latentserve.sampling_params import SamplingParams, StructuredOutputsParams
from latentserve.server.admission import admit
from latentserve.server.anthropic_blocks import (
    AnthropicMetadata,
    AnthropicThinking,
    AnthropicTool,
    AnthropicToolChoice,
    ContentBlock,
    anthropic_tool_choice,
    message_turns,
    openai_tools,
    refuse_bad_cache_control,
    tool_field,
)
from latentserve.server.errors import APIError, anthropic_error, param_from_value_error
from latentserve.server.fields import NOT_COUNTED
from latentserve.server.generation import EngineRequest, TextDelta
from latentserve.server.latent_params import header_error, latent_controls, latent_positions
from latentserve.server.latent_trace import latent_info
from latentserve.server.logprobs import token_texts
from latentserve.server.output_parser import OutputParser, answer_params, parse_output
from latentserve.server.params import (
    check_request_steps,
    check_stop_count,
    refuse_unsupported,
    shared_fields,
)
from latentserve.server.prompts import check_conversation_bytes, render_chat
from latentserve.server.protocol import BODY_CONFIG, LatentFields, RequestModel
from latentserve.server.reasoning import (
    LatentReasoning,
    latent_reasoning_mode,
    latent_reasoning_text,
)
from latentserve.server.request_ids import new_request_id
from latentserve.server.serving import ENGINE_ERRORS, api_error, collect, stream
from latentserve.server.state import ServerState
from latentserve.server.tokenize_pool import in_pool
from latentserve.server.tools import ToolChoice, refuse_unenforced_strict
from latentserve.token_masks import reasoning_open


class AnthropicMessage(RequestModel):
    role: str = Field(json_schema_extra={"enum": ["user", "assistant"]})  # _conversation checks
    content: str | list[ContentBlock]


class MessagesRequest(LatentFields):
    """Anthropic's Messages body; ``fields.ACCEPTED``' fields change nothing."""

    model_config = BODY_CONFIG

    model: str
    max_tokens: int
    messages: list[AnthropicMessage]
    system: str | list[ContentBlock] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = Field(None, ge=0)  # as Anthropic's API (0: no top-k, as -1 is)
    stream: bool | None = False
    metadata: AnthropicMetadata | None = None
    thinking: AnthropicThinking | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    latent_reasoning: str | None = None
    output_config: dict[str, Any] | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    inference_geo: str | None = None
    cache_control: dict[str, Any] | None = None
    speed: str | None = None
    billing_policy: dict[str, Any] | None = None
    fallback_credit_token: str | dict[str, Any] | None = None


def _counted_schema(schema: dict) -> None:
    """CountTokensRequest's JSON schema, in place: MessagesRequest's less ``NOT_COUNTED``."""
    for name in NOT_COUNTED:
        schema["properties"].pop(name, None)
    schema["additionalProperties"] = False


class CountTokensRequest(MessagesRequest):
    """``/v1/messages/count_tokens``: a Messages request without ``max_tokens`` and the other
    fields of ``fields.NOT_COUNTED`` (each refused when sent, as Anthropic's API, and left out
    of its JSON schema)."""

    model_config = ConfigDict(json_schema_extra=_counted_schema)

    max_tokens: int | None = None


def _refuse_not_counted(body: CountTokensRequest) -> None:
    """APIError (400 ``unknown_field`` naming it, as Anthropic's "Extra inputs are not
    permitted") for a field of ``fields.NOT_COUNTED`` in the body, whatever its value."""
    sent = body.model_fields_set | set(body.model_extra or {})
    name = next((name for name in NOT_COUNTED if name in sent), None)
    if name is not None:
        raise APIError(f"Unrecognized request argument supplied: {name}", param=name,
                       code="unknown_field")


def _conversation(body: MessagesRequest) -> list[dict[str, Any]]:
    """The chat template's turns. Raises APIError (400 naming the field)."""
    conversation = message_turns("system", body.system, "system", {}) if body.system else []
    answerable: dict[str, str] = {}  # the previous message's tool_use ids -> names
    for i, message in enumerate(body.messages):
        if message.role not in ("user", "assistant"):
            raise APIError(f"messages.{i}.role: Input should be 'user' or 'assistant', got "
                           f"{message.role!r}", param=f"messages.{i}.role")
        last_assistant = i == len(body.messages) - 1 and message.role == "assistant"
        if message.content in ("", []) and not last_assistant:  # as Anthropic's API
            raise APIError(f"messages.{i}.content: all messages must have non-empty content "
                           "except for the optional final assistant message",
                           param=f"messages.{i}.content")
        if last_assistant and _ends_in_whitespace(message.content):  # as Anthropic's API
            raise APIError(f"messages.{i}.content: final assistant content cannot end with "
                           "trailing whitespace", param=f"messages.{i}.content")
        conversation += message_turns(message.role, message.content,
                                      f"messages.{i}.content", answerable)
        answerable = {block.id: block.name for block in message.content
                      if block.type == "tool_use" and block.id and block.name} \
            if isinstance(message.content, list) and message.role == "assistant" else {}
    if not any(m.role == "user" for m in body.messages):
        raise APIError("messages: at least one message must have role 'user'",
                       param="messages")
    return conversation


def _ends_in_whitespace(content: str | list) -> bool:
    """Whether a message's ``content`` (a string or a list of ``ContentBlock``) ends in a
    text that ends in whitespace."""
    if isinstance(content, list):
        last = content[-1] if content else None
        content = last.text if last is not None and last.type == "text" else None
    return isinstance(content, str) and content != content.rstrip()


def _check(body: MessagesRequest, state: ServerState) -> None:
    """The checks that need no tokenizer: fields, ``cache_control``, ``output_config``,
    model, ``temperature``, stop count. APIError (400 naming the field; 404 for the model)."""
    refuse_unsupported(body)
    refuse_bad_cache_control(body, "")
    for key, value in (body.output_config or {}).items():
        if value is not None and key != "format":
            raise APIError(f"output_config.{key}: it is not supported by this server",
                           param=f"output_config.{key}")
    fmt = (body.output_config or {}).get("format")
    if fmt is not None and not (isinstance(fmt, dict) and fmt.keys() == {"type", "schema"}
                                and fmt["type"] == "json_schema"
                                and isinstance(fmt["schema"], dict)):
        raise APIError('output_config.format: must be {"type": "json_schema", "schema": '
                       "{...}} (a JSON schema object)", param="output_config.format")
    if body.model != state.model_name:
        raise APIError(f"model: {body.model} (this server serves {state.model_name})",
                       status_code=404, param="model", code="model_not_found")
    if body.temperature is not None and not 0.0 <= body.temperature <= 1.0:
        raise APIError(f"temperature: must be in [0, 1], got {body.temperature}",
                       param="temperature")
    check_stop_count(body.stop_sequences, "stop_sequences", state.limits)


def _aborted() -> APIError:
    """The 503 (``api_error``) of a request aborted before it finished (the server's drain at
    shutdown), which no ``stop_reason`` of Anthropic's can say."""
    return APIError("the request was aborted before it finished (the server is shutting "
                    "down); retry it", status_code=503, type="api_error")


def _stop(last: TextDelta, called: bool) -> dict:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` of a choice's ``last`` delta."""
    if last.stop_string is not None:
        reason = "stop_sequence"
    elif called and last.finish_reason == "stop":
        reason = "tool_use"
    else:
        reason = "max_tokens" if last.finish_reason == "length" else "end_turn"
    return {"stop_reason": reason, "stop_sequence": last.stop_string}


@dataclass(slots=True)
class _Answer:
    """How a request's answer is shaped: tools by name, choice, ``thinking`` (None: absent),
    latent mode."""

    tools: dict[str, dict]
    choice: ToolChoice
    flag: bool | None
    latent_mode: str | None
    opened: bool | None = None  # the answer starts in its reasoning (None: the default)

    def parser(self, state: ServerState) -> OutputParser:
        return OutputParser(state.reasoning_parser, state.tool_parser, self.choice,
                            self.flag is True, id_prefix="toolu_", opened=self.opened)


async def _prompt(body: MessagesRequest, state: ServerState) -> tuple[_Answer, list[int]]:
    """The answer's shape and the templated prompt, ``thinking`` as the template's
    ``thinking`` / ``enable_thinking``. APIError (400 naming the field) for bad tools,
    ``tool_choice``, ``thinking.type``, ``latent_reasoning`` or messages."""
    tool_dicts, tools = openai_tools(body.tools)
    choice = anthropic_tool_choice(body.tool_choice, tools)
    refuse_unenforced_strict(tools, choice, state.tool_parser, lambda i, key: f"tools.{i}.{key}")
    flag = None if body.thinking is None else body.thinking.type == "enabled"
    if body.thinking is not None and body.thinking.type not in ("enabled", "disabled"):
        raise APIError(f"thinking.type must be 'enabled' or 'disabled', got "
                       f"{body.thinking.type!r}", param="thinking.type")
    mode = latent_reasoning_mode(body, state.latent_spec)
    if body.latent_reasoning is not None and flag is not True:
        raise APIError("latent_reasoning: it writes the thinking block, which needs thinking "
                       '{"type": "enabled"}', param="latent_reasoning")
    conversation = _conversation(body)
    check_conversation_bytes(conversation, state.tokenizer, state.max_model_len)
    kwargs = None if flag is None else {"thinking": flag, "enable_thinking": flag}
    ids = await in_pool(
        render_chat, state.tokenizer, conversation, tools=tool_dicts, template_kwargs=kwargs,
        continue_final_message=conversation[-1]["role"] == "assistant")
    return _Answer(tools, choice, flag, mode if flag else None,
                   reasoning_open(state.tokenizer, state.reasoning_parser, ids)), ids


async def count_input_tokens(body: CountTokensRequest, request, state: ServerState) -> int:
    """The prompt tokens ``/v1/messages`` would take, after all its checks (the engine's
    too); room for one answer token. APIError: 400, 404, 503."""
    _refuse_not_counted(body)
    _check(body, state)
    answer, prompt_ids = await _prompt(body, state)
    params = _request_params(body, request, state, prompt_ids, answer)
    try:
        await state.client.check(uuid.uuid4().hex, prompt_ids, params)
    except ENGINE_ERRORS as exc:
        raise api_error(exc, request) from None
    return len(prompt_ids)


def _request_params(body: MessagesRequest, request, state: ServerState,
                    prompt_ids: list[int], answer: _Answer) -> SamplingParams:
    """The engine's ``SamplingParams``, ``answer.flag`` as the head's thinking where it means
    one; latent KV positions and ``max_tokens`` (None: one answer token) count against the
    context. Raises APIError (400 naming the field or header; ``context_length_exceeded``)."""
    kind = getattr(state.latent_spec, "kind", None)
    shows = state.reasoning_parser is not None or kind in ("feedback", "loop")
    # thinking disabled is passed on any model: it makes head controls harmless (server.md)
    flag = answer.flag if kind == "head" or answer.flag is False or (
        answer.flag and not shows) else None
    budget, head, _ = latent_controls(request, body.model_copy(update={"thinking": flag}),
                                      state.latent_spec)  # no ticks on /v1/messages
    max_len, asked, num_prompt_tokens = state.max_model_len, body.max_tokens, len(prompt_ids)
    thinking_budget = body.thinking.budget_tokens if answer.flag else None
    latent = latent_positions(state.latent_spec, budget, head, prompt_ids, thinking_budget)
    if num_prompt_tokens + latent + (1 if asked is None else asked) > max_len:
        extra = f" + {latent} latent and transition positions" if latent else ""
        answer_room = "1 answer token" if asked is None else f"max_tokens {asked}"
        raise APIError(f"prompt is too long: {num_prompt_tokens} tokens{extra} + {answer_room} "
                       f"> the maximum context length {max_len}", code="context_length_exceeded",
                       param="messages" if asked is None or num_prompt_tokens >= max_len
                       else "max_tokens")
    fmt = (body.output_config or {}).get("format")
    try:
        params = SamplingParams(  # thinking_token_budget: <think> tokens or latent positions
            max_tokens=1 if asked is None else asked,
            structured_outputs=fmt and StructuredOutputsParams(json=fmt["schema"],
                                                               param="output_config.format"),
            thinking_token_budget=thinking_budget,
            **{k: v for k, v in head.items() if v is not None},
            **shared_fields(body, list(body.stop_sequences or []), budget,
                            state.sampling_defaults))
    except ValueError as exc:  # SamplingParams' stop is stop_sequences here
        msg, param = str(exc), param_from_value_error(str(exc))
        if param == "stop":
            msg, param = "stop_sequences" + msg.removeprefix(param), "stop_sequences"
        raise header_error(request, msg, param) from None
    check_request_steps([(prompt_ids, params)], 1, "max_tokens", state, request)
    return answer_params(params, answer.choice, answer.tools, answer.latent_mode,
                         state.tokenizer, answer.parser(state), tool_field)


async def create_message(body: MessagesRequest, request, state: ServerState):
    """Validate, admit, template, run; answer with a ``message`` or an SSE event stream.
    APIError: 400, 404, 503 ``overloaded`` (529 here), 503 for a request aborted before it
    finished, or ``serving.api_error``'s."""
    arrival = time.monotonic()
    _check(body, state)
    with admit(state, 1) as ticket:
        answer, prompt_ids = await _prompt(body, state)
        params = _request_params(body, request, state, prompt_ids, answer)
        msg_id, engine_rid = new_request_id(request, "msg")
        if msg_id == engine_rid:
            msg_id = engine_rid = "msg_" + engine_rid.removeprefix("msg-")
        reqs = [EngineRequest(engine_rid, prompt_ids, params)]
        asked = bool(body.return_latent_trace)
        texts = token_texts(state.tokenizer)
        if body.stream:
            return await stream(
                request, state, reqs, arrival, ticket, lambda deltas: _events(
                    msg_id, state.model_name, len(prompt_ids), deltas, asked,
                    answer.parser(state), answer.latent_mode, texts),
                error_event=lambda err: _event(anthropic_error(err)[1]), done=None)
        result = (await collect(request, state, reqs, arrival, ticket))[0]
        if result.finish_reason == "abort":
            raise _aborted()
        reasoning, content, calls = parse_output(answer.parser(state), result.text)
        if answer.latent_mode:
            reasoning = latent_reasoning_text(answer.latent_mode, result.latent_steps,
                                              result.step_trace, texts) + reasoning
        blocks = [{"type": "thinking", "thinking": reasoning, "signature": ""}] if reasoning \
            else []
        uses = [{"type": "tool_use", "id": c.id, "name": c.name,
                 "input": complete_members(c.arguments)} for c in calls]
        if content or not uses:
            blocks.append({"type": "text", "text": content})
        msg = _message(msg_id, state.model_name, blocks + uses, len(prompt_ids),
                       result.num_output_tokens, _stop(result, bool(uses)))
        return _with_latent(msg, latent_info(result, asked, texts))


def complete_members(arguments: str) -> dict:
    """A tool call's ``input``: ``arguments`` parsed, or, cut short (``max_tokens``), the
    members of its JSON object that are complete, as Anthropic closes a truncated
    ``tool_use`` block (``stop_reason`` then says ``max_tokens``): each member followed by
    ``,`` or ``}``; ``{}`` for no object."""
    try:
        value = json.loads(arguments)
        return value if isinstance(value, dict) else {}
    except json.JSONDecodeError:
        pass
    decode, out = json.JSONDecoder().raw_decode, {}
    text = arguments.strip()

    def skip(j: int) -> int:  # past white space from j
        return len(text) - len(text[j:].lstrip())

    i = 1 if text.startswith("{") else len(text)
    while True:  # "key": value pairs until one is cut
        try:
            key, i = decode(text, skip(i))
            i = skip(i)
            if not isinstance(key, str) or text[i] != ":":
                return out
            value, i = decode(text, skip(i + 1))
        except (ValueError, IndexError):
            return out
        i = skip(i)
        if text[i:i + 1] not in (",", "}"):  # a number at the cut may be cut itself
            return out
        out[key] = value
        if text[i] == "}":
            return out
        i += 1


def _with_latent(obj: dict, info) -> dict:
    """``obj`` with the extension field ``latent`` when there is one."""
    if info is not None:
        obj["latent"] = {k: v for k, v in info.items() if v is not None}
    return obj


def _message(msg_id: str, model: str, content: list, input_tokens: int, output_tokens: int,
             stop: dict) -> dict:
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content, **stop,
            "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens}}


def _event(data: dict) -> str:
    return f"event: {data['type']}\ndata: {json.dumps(data)}\n\n"


class _Blocks:
    """A streamed message's content blocks as SSE events, handed out by :meth:`take`."""

    def __init__(self):
        self.index = -1
        self.kind: str | None = None
        self.events: list[str] = []

    def add(self, kind: str, **fields) -> None:
        """A ``content_block_{kind}`` event (``start``, ``delta``, ``stop``) of the open block."""
        self.events.append(_event({"type": f"content_block_{kind}", "index": self.index,
                                   **fields}))

    def open(self, block: dict) -> None:
        self.close()
        self.index += 1
        self.kind = block["type"]
        self.add("start", content_block=block)

    def write(self, block: dict, delta: dict) -> None:
        """``delta`` into the open block if it is of ``block``'s type, else into ``block``."""
        if self.kind != block["type"]:
            self.open(block)
        self.add("delta", delta=delta)

    def close(self) -> None:
        if self.kind == "thinking":
            self.add("delta", delta={"type": "signature_delta", "signature": ""})
        if self.kind is not None:
            self.add("stop")
        self.kind = None

    def take(self) -> list[str]:
        out, self.events = self.events, []
        return out


async def _events(msg_id: str, model: str, input_tokens: int,
                  deltas: AsyncIterator[tuple[int, TextDelta]], asked: bool,
                  parser: OutputParser, latent_mode: str | None, texts
                  ) -> AsyncIterator[str]:
    latent = LatentReasoning(latent_mode, texts) if latent_mode else None
    yield _event({"type": "message_start", "message": _message(
        msg_id, model, [], input_tokens, 0, {"stop_reason": None, "stop_sequence": None})})
    yield _event({"type": "ping"})
    blocks = _Blocks()
    last, called = None, False
    async for _, delta in deltas:
        piece = parser.step(delta.text, delta.finish_reason is not None)
        thinking = "".join(latent.step_texts(delta) if latent else ()) + piece.reasoning
        if thinking:
            blocks.write({"type": "thinking", "thinking": "", "signature": ""},
                         {"type": "thinking_delta", "thinking": thinking})
        if piece.content:
            blocks.write({"type": "text", "text": ""},
                         {"type": "text_delta", "text": piece.content})
        for call in piece.calls:
            called = True
            if call.id is not None:
                blocks.open({"type": "tool_use", "id": call.id, "name": call.name, "input": {}})
            if call.arguments:
                blocks.add("delta", delta={"type": "input_json_delta",
                                           "partial_json": call.arguments})
        for e in blocks.take():
            yield e
        last = delta
    if last.finish_reason == "abort":  # no stop_reason says it: Anthropic's error event
        yield _event(anthropic_error(_aborted())[1])
        return
    if blocks.index < 0:  # an empty answer: one empty text block, as when not streamed
        blocks.open({"type": "text", "text": ""})
    blocks.close()
    for e in blocks.take():
        yield e
    yield _event(_with_latent({
        "type": "message_delta", "delta": _stop(last, called),
        "usage": {"output_tokens": last.num_output_tokens}},
        latent_info(last, asked, texts)))
    yield _event({"type": "message_stop"})
