"""Pydantic models of the OpenAI ``/v1/chat/completions`` and ``/v1/completions`` APIs, and
of ``/tokenize`` / ``/detokenize`` (vLLM's shapes).

Requests are validated strictly (``"5"`` is not an integer, ``"yes"`` is not a boolean), as
OpenAI does. Unknown fields are kept in ``model_extra`` (the handlers refuse the OpenAI
features that are not implemented rather than silently ignore them). Values are
range-checked later, by ``SamplingParams`` and the handlers, so the error names the field
and the allowed range.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer


def no_lone_surrogates(value):
    """Reject text holding a lone UTF-16 surrogate (JSON ``"\\ud800"`` decodes to one): it
    cannot be encoded as UTF-8, so tokenizers and responses would fail on it. Checks
    strings and strings inside lists and dicts; returns ``value``. Raises ValueError."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("text contains a lone UTF-16 surrogate (not valid Unicode)") \
                from None
    elif isinstance(value, list):
        for v in value:
            no_lone_surrogates(v)
    elif isinstance(value, dict):
        for k, v in value.items():
            no_lone_surrogates(k)
            no_lone_surrogates(v)
    return value


class RequestModel(BaseModel):
    """Base of every request body (OpenAI and Anthropic routes): strict types, unknown
    fields kept, text checked for lone surrogates."""

    model_config = ConfigDict(strict=True, extra="allow")

    @field_validator("*", mode="after")
    @classmethod
    def _text_is_unicode(cls, value):
        return no_lone_surrogates(value)


class StreamOptions(RequestModel):
    include_usage: bool | None = False


class LatentFields(RequestModel):
    """The latent-reasoning body fields every generation route takes (the OpenAI routes and
    Anthropic's ``/v1/messages``), all None by default."""

    # Latent reasoning: None = the model's default budget, 0 = no thinking (header
    # x-latent-budget wins).
    latent_budget: int | None = None
    # Recurrent-depth models (Huginn, Ouro): the per-token exit rule (SamplingParams' fields;
    # None = the model's default).
    exit_criterion: str | None = None
    exit_threshold: float | None = None
    exit_min_steps: int | None = None
    exit_check_every: int | None = None
    # Huginn's exit semantics, "engine" or "upstream" (None = the server's --exit-semantics).
    exit_semantics: str | None = None
    # Compression heads (latent/head.py): None = the server default (LATENTSERVE_* env);
    # headers x-latent-* (aliases x-ds4-*) win over these (server/params.head_controls).
    max_latent: int | None = None
    min_latent: int | None = None
    use_stop: bool | None = None
    stop_threshold: float | None = None
    min_output_tokens: int | None = None
    # CoLaR models (latent/colar_head.py): None = the model's default; headers
    # x-latent-compression-factor / x-latent-temperature win.
    compression_factor: int | None = None
    latent_temperature: float | None = None
    # End on EOS as the family's upstream code does (COCONUT, PCCoT); None = the server's
    # --upstream-stop-rules (off unless given); true on another family is a 400.
    upstream_stop_rules: bool | None = None


class JsonSchemaFormat(RequestModel):
    """``response_format.json_schema``: OpenAI's ``{"name", "description", "schema",
    "strict"}`` (the schema is what the answer follows; the rest is informational)."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True,
                              serialize_by_alias=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(RequestModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON
    object) or ``json_schema`` (``json_schema.schema``)."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredFields(RequestModel):
    """Token masks and structured outputs (vLLM's fields and OpenAI's ``response_format``;
    ``SamplingParams`` documents them). At most one constraint field per request."""

    min_tokens: int | None = None
    include_stop_str_in_output: bool | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[int] | None = None
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's newer form: {"json" | "regex" | "choice" | "grammar" | "json_object": ...}
    structured_outputs: dict[str, Any] | None = None


class SamplingRequest(LatentFields, StructuredFields):
    """Fields shared by both OpenAI endpoints."""

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
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    return_tokens_as_token_ids: bool | None = False
    return_latent_trace: bool | None = False
    # Streamed chat: one reasoning_content tick per latent step (header x-latent-stream-steps
    # wins); see server/chat.py.
    stream_latent_steps: bool | None = None
    thinking: bool | None = None  # compression heads; Anthropic's route takes an object

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ContentPart(RequestModel):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is served."""

    type: str
    text: str | None = None


class FunctionCall(RequestModel):
    """The function an assistant turn called: ``arguments`` is OpenAI's JSON string (an
    object is taken too)."""

    name: str
    arguments: str | dict[str, Any] | None = None


class ToolCall(RequestModel):
    id: str | None = None
    type: str = "function"
    function: FunctionCall


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(RequestModel):
    """One turn: ``tool_calls`` on assistant turns, ``tool_call_id`` on tool results;
    ``name`` names the speaker (or, on a tool message, the function). ``role`` is one of
    ``CHAT_ROLES`` (checked by ``prompts.chat_conversation``, which names the message)."""

    role: str = Field(json_schema_extra={"enum": list(CHAT_ROLES)})
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(RequestModel):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(RequestModel):
    """A tool the model may call, shown to it by the chat template (``server/tools.py``)."""

    type: str
    function: FunctionDefinition


class ChatCompletionRequest(SamplingRequest):
    """``logprobs`` / ``top_logprobs``: OpenAI's chat fields. ``tools`` and
    ``chat_template_kwargs`` go to the chat template; ``tool_choice`` and
    ``parallel_tool_calls`` are OpenAI's (``server/tools.py``); ``add_generation_prompt``
    and ``continue_final_message`` are vLLM's (continue the last, assistant, message
    instead of starting a new one), as are ``chat_template`` and ``echo``.
    ``include_reasoning`` (vLLM's; false: no ``reasoning_content``) and
    ``latent_reasoning`` (``"count"`` or ``"logit_lens"``: how a latent model's steps are
    written into ``reasoning_content``; ``server/reasoning.py``)."""

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
    # vLLM's: a Jinja chat template used instead of the model's (needs the server's
    # --trust-request-chat-template), and the last (assistant) message's content prepended
    # to the answer.
    chat_template: str | None = None
    echo: bool | None = False

    def with_template_kwargs_fields(self) -> ChatCompletionRequest:
        """This request with the latent body fields (``TEMPLATE_KWARGS_FIELDS``) that came
        inside ``chat_template_kwargs`` moved to the top level. A router that rebuilds the
        OpenAI body from its own schema drops unknown top-level fields and ``x-`` headers but
        keeps ``chat_template_kwargs`` (sglang-router 0.3.2; docs/scaling.md). The top-level
        field, when set, wins; values are validated as top-level ones.

        Raises:
            APIError: naming ``chat_template_kwargs.<field>`` for a value of the wrong type.
        """
        from pydantic import ValidationError

        from latentserve.server.errors import APIError

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
TEMPLATE_KWARGS_FIELDS = (*LatentFields.model_fields, "return_latent_trace",
                          "stream_latent_steps", "latent_reasoning")


class CompletionRequest(SamplingRequest):
    """``prompt``: a string, token ids, or a list of either (one choice set per prompt).
    ``logprobs``: how many top tokens to report per position (0: the sampled one only).
    ``echo``: prepend the prompt to each choice's text."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False


class TokenizeRequest(RequestModel):
    """``/tokenize``: either ``prompt`` (plain encoding) or ``messages`` (chat template,
    rendered as ``/v1/chat/completions`` renders it: ``tools``, ``chat_template``,
    ``chat_template_kwargs``, ``add_generation_prompt`` and ``continue_final_message`` mean
    the same there)."""

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
    model: str | None = None
    tokens: list[int]


# --- responses ---------------------------------------------------------------------------


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                   total_tokens=prompt_tokens + completion_tokens)


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    """``reasoning_content``: what a thinking model produced before its answer, its
    ``<think>`` text or its latent steps ("" when nothing was produced; ``server/
    reasoning.py``). ``tool_calls`` (left out when None): the calls parsed out of the
    answer; ``content`` is then null when no text came with them."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str = ""
    tool_calls: list[ToolCallOut] | None = None

    @model_serializer(mode="wrap")
    def _drop_null_calls(self, handler) -> dict[str, Any]:
        out = handler(self)
        if out.get("tool_calls") is None:
            out.pop("tool_calls", None)
        return out


class LatentInfo(BaseModel):
    """What one choice spent on latent reasoning: ``steps`` latent positions run (0 for a
    recurrent-depth model, which runs none: its budget is in ``recurrence``), and with
    ``return_latent_trace`` the ``trace``: per latent step ``{"norm", "top_tokens": [[id,
    logit], ...], "top_probs", "top_texts"}`` (feedback models, compression heads with
    ``stop_prob``; ``server/latent_trace.py``), or per generated token ``{"depth"}`` (Huginn)
    / ``{"depth", "readout_step", "exit_probs"}`` (Ouro; ``readout_step`` null for the
    weighted readout), or per block position of each pass the lens entry with ``"pass"``,
    ``"position"`` (looped blocks), as ``SamplingParams.return_latent_trace`` says.
    Streamed, it is on the final chunk, and with ``stream_latent_steps`` on each latent
    step's chunk: ``steps`` that step's number and ``trace`` its entry alone."""

    steps: int
    trace: list[dict] | None = None
    # Compression heads: thinking, mode, steps, stop_step, max_stop_prob, end (stop|cap|
    # length) and the resolved controls; thinking False says the head was not used.
    stats: dict | None = None
    # Recurrent depth, with return_latent_trace: iterations per generated token,
    # {"tokens": n, "mean_iterations": float, "histogram": {"iterations": count}}.
    recurrence: dict | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None
    latent: LatentInfo | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    """A streamed message fragment; unset fields are left out of the JSON. ``tool_calls``:
    OpenAI's call pieces, ``{"index", "id", "type", "function": {"name", "arguments"}}``
    on a call's first piece and ``{"index", "function": {"arguments"}}`` after."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer
    def _drop_none(self) -> dict[str, Any]:
        return {k: v for k, v in (("role", self.role), ("content", self.content),
                                  ("reasoning_content", self.reasoning_content),
                                  ("tool_calls", self.tool_calls))
                if v is not None}


class ChatChunkChoice(BaseModel):
    """One choice of a streamed chunk. ``latent`` (left out of the JSON when None) rides on
    the choice's finish chunk, as on a non-streamed choice."""

    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    latent: LatentInfo | None = None

    @model_serializer(mode="wrap")
    def _drop_null_latent(self, handler) -> dict[str, Any]:
        out = handler(self)
        if out.get("latent") is None:
            out.pop("latent", None)
        return out


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per generated token;
    ``text_offset`` is each token's start in the choice's text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    latent: LatentInfo | None = None


class CompletionResponse(_Response):
    """Both the non-streamed response and each streamed chunk (OpenAI uses one shape)."""

    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    """One ``/v1/models`` entry, with vLLM's extra keys (``vllm/entrypoints/openai/
    protocol.py``: ``root`` the model path, ``parent`` None but for adapters,
    ``max_model_len``), so that ``vllm bench serve`` and lm-eval find the model; ``latent``:
    the model's latent family and the controls it takes (``server/latent_card.py``; null for
    a plain model)."""

    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "latentserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int
    latent: dict[str, Any] | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
