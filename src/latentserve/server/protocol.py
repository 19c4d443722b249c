"""Pydantic request models of OpenAI's ``/v1/chat/completions`` and ``/v1/completions`` and
vLLM's ``/tokenize`` / ``/detokenize`` (strict types, as OpenAI's; undeclared fields refused by
``params.refuse_unsupported``, ranges checked by ``SamplingParams`` and the handlers); the
responses are plain dicts."""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from latentserve.server.errors import APIError


def no_lone_surrogates(value):
    """``value``; ValueError if a string in it (nested too) holds a lone UTF-16 surrogate.
    Walks with a stack, not recursion: JSON nested past Python's recursion limit is checked."""
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("text contains a lone UTF-16 surrogate (not valid Unicode)") \
                    from None
        elif isinstance(v, (list, tuple, dict)):
            stack.extend(v.items() if isinstance(v, dict) else v)  # a dict's keys too
    return value


class RequestModel(BaseModel):
    """Base of every request body (OpenAI and Anthropic routes) and of the objects in it:
    strict types, unknown fields kept, text checked for lone surrogates. Inside a body,
    ``params.refuse_nested`` refuses the keys an object does not take (``taken_keys``),
    except those of ``UNUSED`` at a value it serves."""

    model_config = ConfigDict(strict=True, extra="allow")
    _text_is_unicode = field_validator("*", mode="after")(staticmethod(no_lone_surrogates))
    # Keys the protocol defines for this object and this server does not implement: key ->
    # the values that mean "not used" (served); another value is a 400 naming the key.
    UNUSED: ClassVar[dict[str, tuple]] = {}
    # The keys each ``type`` of this object takes (None: its declared fields, whatever
    # its type); a type not listed is refused by the route, naming the type.
    TYPE_KEYS: ClassVar[dict[str | None, tuple[str, ...]] | None] = None

    def taken_keys(self) -> tuple[str, ...] | None:
        """The keys this object takes; None when its ``type`` is not served."""
        if self.TYPE_KEYS is None:
            return tuple(type(self).model_fields)
        return self.TYPE_KEYS.get(getattr(self, "type", None))


# The config of a route's body: /openapi.json lists no other top-level field (one is a 400).
BODY_CONFIG = ConfigDict(json_schema_extra={"additionalProperties": False})


class StreamOptions(RequestModel):
    """OpenAI's ``stream_options``; another key (``continuous_usage_stats``,
    ``include_obfuscation``) is a 400: not implemented."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool | None = False


class LatentFields(RequestModel):
    """The latent body fields of every generation route (``SamplingParams``' meanings)."""

    latent_budget: int | None = None
    exit_criterion: str | None = None
    exit_threshold: float | None = None
    exit_min_steps: int | None = None
    exit_check_every: int | None = None
    exit_semantics: str | None = None
    max_latent: int | None = None
    min_latent: int | None = None
    use_stop: bool | None = None
    stop_threshold: float | None = None
    min_output_tokens: int | None = None
    compression_factor: int | None = None
    latent_temperature: float | None = None
    upstream_stop_rules: bool | None = None
    return_latent_trace: bool | None = False


class JsonSchemaFormat(RequestModel):
    """``response_format.json_schema``; only ``schema`` constrains the answer."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True, extra="forbid")

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's ``response_format`` (another key is a 400)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class SamplingRequest(LatentFields):
    """Fields shared by both OpenAI endpoints; at most one structured-output constraint."""

    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[str, float] | None = None  # token id (a decimal string) -> bias
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    n: int | None = 1
    echo: bool | None = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_tokens_as_token_ids: bool | None = False
    return_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = None
    stream_latent_steps: bool | None = None
    thinking: bool | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(RequestModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is served
    (``prompt_cache_breakpoint``, a caching hint, has no effect)."""

    TYPE_KEYS = {"text": ("type", "text", "prompt_cache_breakpoint")}

    type: str
    text: str | None = None
    prompt_cache_breakpoint: dict[str, Any] | None = None


class FunctionCall(RequestModel):
    """A called function; ``arguments`` is a JSON string or an object."""

    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCall(RequestModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(RequestModel):
    """One turn of the conversation; an assistant turn's reasoning, as the responses carry it
    (``reasoning``, vLLM's newer name, or ``reasoning_content``; both only when equal), goes
    to the chat template under both names."""

    UNUSED = {"refusal": (None,), "audio": (None,), "function_call": (None,),
              "annotations": (None, [])}

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None


class FunctionDefinition(RequestModel):
    """A function tool; ``strict: true`` holds only where calls are decoded under
    ``parameters`` (``tools.refuse_unenforced_strict``)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(RequestModel):
    """A tool the chat template shows the model (``server/tools.py``)."""

    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(SamplingRequest):
    """OpenAI's and vLLM's chat fields; ``latent_reasoning`` (``"count"`` or ``"logit_lens"``):
    how latent steps are written into ``reasoning_content`` (``server/reasoning.py``)."""

    model_config = BODY_CONFIG

    messages: list[ChatMessage]
    tools: list[ChatTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    include_reasoning: bool | None = True
    latent_reasoning: str | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None

    def with_template_kwargs_fields(self) -> ChatCompletionRequest:
        """This request with ``TEMPLATE_KWARGS_FIELDS`` of ``chat_template_kwargs`` moved to
        the top level unless set there (docs/scaling.md). APIError naming the field."""
        kw = self.chat_template_kwargs or {}
        moved = {k: kw[k] for k in TEMPLATE_KWARGS_FIELDS
                 if k in kw and k not in self.model_fields_set}
        if not moved:
            return self
        try:
            return type(self).model_validate({**self.model_dump(exclude_unset=True), **moved})
        except ValidationError as exc:
            err = exc.errors()[0]
            name = f"chat_template_kwargs.{err['loc'][0]}"
            raise APIError(f"{name}: {err['msg']}", param=name) from None


# Latent body fields a chat request may also send inside chat_template_kwargs.
TEMPLATE_KWARGS_FIELDS = (*LatentFields.model_fields, "stream_latent_steps", "latent_reasoning")


class CompletionRequest(SamplingRequest):
    """``prompt``: a string, token ids, or a list of either (one choice set per prompt)."""

    model_config = BODY_CONFIG

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None


class TokenizeRequest(RequestModel):
    """``/tokenize``: ``prompt`` (plain) or ``messages`` (templated as on the chat route)."""

    model_config = BODY_CONFIG

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    add_special_tokens: bool | None = True
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(RequestModel):
    model_config = BODY_CONFIG

    model: str | None = None
    tokens: list[int]


# --- responses: plain dicts, keys in the order they are written --------------------------


def usage_of(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response(kind: str, rid: str, model: str, choices: list, usage: dict | None = None) -> dict:
    """A chat or text completion, or one of its stream chunks (``object`` ``kind``)."""
    return {"id": rid, "created": int(time.time()), "model": model, "object": kind,
            "choices": choices, "usage": usage}
