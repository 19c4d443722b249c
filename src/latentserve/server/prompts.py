"""Prompts -> token ids: chat templates for chat, plain encoding for completions; the
``--chat-template`` and a request's ``chat_template``, read as vLLM reads them
(``load_chat_template``, ``_validate_chat_template`` in ``vllm/entrypoints/chat_utils.py``)."""

from __future__ import annotations

import codecs
import functools
import json
import re
from typing import Any

from latentserve.models.checkpoint import NO_TOKENIZER, NoTokenizer
from latentserve.sampling_params import prompt_tokens_kept
from latentserve.server.errors import APIError
from latentserve.server.protocol import ChatMessage, ChatTool, ToolCall
from latentserve.server.tokenize_pool import in_pool

# A --chat-template value with none of these characters is taken for a file path.
_JINJA_CHARS = "{}\n"
TRUST_FLAG = "--trust-request-chat-template"


def _jinja_error(text: str) -> str | None:
    """Why ``text`` is not a valid Jinja template, or None."""
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as exc:
        return str(exc)
    return None


def load_chat_template(value: str | None) -> str | None:
    """The Jinja text of ``value``: a file's text, else ``value`` unescaped. ValueError for an
    unreadable path (no ``{``, ``}`` or newline) or invalid Jinja."""
    if value is None:
        return None
    try:
        with open(value, encoding="utf-8") as f:
            text = f.read()
    except OSError as exc:
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it "
                             f"cannot be read: {exc.strerror or exc}") from None
        text = codecs.decode(value, "unicode_escape")
    if (error := _jinja_error(text)) is not None:
        raise ValueError(f"--chat-template is not a valid Jinja template: {error}")
    return text


def apply_chat_template(tokenizer, template: str | None) -> None:
    """Make ``template`` (unless None) the chat template of ``tokenizer``; ValueError."""
    if template is None:
        return
    if isinstance(tokenizer, NoTokenizer):
        msg = "--chat-template: this model directory has no tokenizer files (token ids only)"
        raise ValueError(msg)  # noqa: TRY004 - a bad flag value: the CLI's one-line error
    tokenizer.chat_template = template


# Arguments of apply_chat_template that a client may not set through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "return_dict", "return_tensors", "tools",
    "documents", "chat_template", "padding", "truncation", "max_length",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def chat_conversation(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI messages -> the chat template's turns (``developer`` becomes ``system``; ``name``
    and ``tool_call_id`` kept; the reasoning as ``reasoning_content`` and ``reasoning``).
    APIError (400) for non-text content, tool-call arguments that are not JSON, ``reasoning``
    and ``reasoning_content`` that differ, or no system, developer or user message."""
    conversation = []
    for i, message in enumerate(messages):
        turn = {"role": "system" if message.role == "developer" else message.role,
                "content": message_text(message, i),
                **message.model_dump(include={"name", "tool_call_id"}, exclude_none=True)}
        said = {message.reasoning, message.reasoning_content} - {None}
        if len(said) > 1:
            raise APIError(f"messages[{i}].reasoning: differs from its reasoning_content (give "
                           "one, or both equal)", param=f"messages[{i}].reasoning")
        if said:
            turn["reasoning_content"] = turn["reasoning"] = said.pop()
        if message.tool_calls is not None:
            turn["tool_calls"] = [_tool_call(call, f"messages[{i}].tool_calls[{j}]")
                                  for j, call in enumerate(message.tool_calls)]
        conversation.append(turn)
    if not any(m["role"] in ("system", "user") for m in conversation):
        raise APIError("messages must contain at least one message with role 'system', "
                       "'developer' or 'user'", param="messages")
    return conversation


def _tool_call(call: ToolCall, param: str) -> dict[str, Any]:
    """A tool call with its JSON-string ``arguments`` parsed (templates ``tojson`` them)."""
    args = call.function.arguments
    if isinstance(args, str) and args.strip():
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            raise APIError(f"{param}.function.arguments is not valid JSON: {exc}",
                           param=f"{param}.function.arguments") from None
    out = {"type": call.type, "function": {"name": call.function.name, "arguments": args or {}}}
    return out if call.id is None else {"id": call.id, **out}


def chat_tools(tools: list[ChatTool] | None) -> list[dict[str, Any]] | None:
    """``tools`` as dicts for the chat template."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


def render_chat(tokenizer, conversation: list[dict[str, Any]], *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None,
                tools: list[dict[str, Any]] | None = None, chat_template: str | None = None
                ) -> list[int]:
    """The prompt's token ids from the tokenizer's chat template (or ``chat_template``);
    ``continue_final_message`` leaves the last (assistant) message open. APIError (400) for
    no tokenizer or template, a reserved template keyword, no final assistant message to
    continue, or a template that fails or renders no tokens."""
    if isinstance(tokenizer, NoTokenizer):
        raise APIError(f"{NO_TOKENIZER} to /v1/completions", param="messages")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError("this model's tokenizer has no chat template; use /v1/completions",
                       param="messages")
    kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt,
                              "continue_final_message": continue_final_message,
                              **(template_kwargs or {})}
    if reserved := [key for key in kwargs if key in _RESERVED_TEMPLATE_KWARGS]:
        raise APIError(f"chat_template_kwargs may not set {reserved[0]!r}",
                       param="chat_template_kwargs")
    if kwargs["continue_final_message"]:
        if not conversation or conversation[-1]["role"] != "assistant":
            raise APIError("continue_final_message needs a final message with role "
                           "'assistant'", param="continue_final_message")
        kwargs["add_generation_prompt"] = False
    if chat_template is not None:
        kwargs["chat_template"] = chat_template
    try:
        out = tokenizer.apply_chat_template(conversation, tools=tools, **kwargs)
    except Exception as exc:  # noqa: BLE001 - jinja errors, template raise_exception(...)
        raise APIError(f"the chat template failed on these messages: "
                       f"{type(exc).__name__}: {exc}", param="messages") from None
    ids = list(out["input_ids"] if hasattr(out, "keys") else out)
    if not ids:
        whose = "the request's chat_template" if chat_template is not None else \
            "the model's chat template"
        raise APIError(f"{whose} rendered these messages as an empty prompt",
                       param="chat_template" if chat_template is not None else "messages")
    return ids


async def templated_prompt_ids(body, state, template_kwargs: dict[str, Any] | None,
                               max_model_len: int | None = None) -> list[int]:
    """:func:`render_chat` of a chat or ``/tokenize`` body in the tokenizer pool, after
    :func:`check_conversation_bytes` (with ``max_model_len``). APIError (400) for
    ``continue_final_message`` with ``add_generation_prompt`` sent true, as vLLM refuses it
    (its default true alone is dropped for ``continue_final_message``), or a ``chat_template``
    without ``--trust-request-chat-template`` or that is not valid Jinja."""
    if body.continue_final_message and body.add_generation_prompt is True \
            and "add_generation_prompt" in body.model_fields_set:
        raise APIError("Cannot set both `continue_final_message` and `add_generation_prompt` "
                       "to True.", param="continue_final_message")
    template = body.chat_template
    if template is not None and not state.trust_request_chat_template:
        raise APIError(f"chat_template: a chat template was passed with the request, but the "
                       f"server was not started with {TRUST_FLAG}; the request is refused",
                       param="chat_template")
    if template is not None and (error := _jinja_error(template)) is not None:
        raise APIError(f"chat_template is not a valid Jinja template: {error}",
                       param="chat_template")

    def render(tokenizer) -> list[int]:
        conversation = chat_conversation(body.messages)
        if max_model_len is not None:
            check_conversation_bytes(conversation, tokenizer, max_model_len)
        return render_chat(tokenizer, conversation, tools=chat_tools(body.tools),
                           template_kwargs=template_kwargs, chat_template=template,
                           add_generation_prompt=body.add_generation_prompt is not False,
                           continue_final_message=bool(body.continue_final_message))

    return await in_pool(render, state.tokenizer)


def message_text(message: ChatMessage, i: int) -> str:
    """Message ``i``'s content as text; APIError (400 naming the part) for a null user,
    system or developer content, or a part that is not text."""
    content = message.content
    if content is None:
        if message.role in ("user", "system", "developer"):
            raise APIError(f"a {message.role} message needs content (a string or a list of "
                           "text parts), got null", param=f"messages[{i}].content")
        return ""
    if isinstance(content, str):
        return content
    for j, part in enumerate(content):
        if part.type != "text":
            raise APIError(f"only text content parts are supported, got type {part.type!r}",
                           param=f"messages[{i}].content[{j}]")
        if part.text is None:
            raise APIError("a text content part needs a string 'text'",
                           param=f"messages[{i}].content[{j}].text")
    return "\n".join(part.text for part in content)  # as vLLM's string content format


def prompt_list(prompt, max_prompts: int) -> list:
    """A completions ``prompt`` as a list of prompts; APIError for over ``max_prompts``."""
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > max_prompts:
            raise APIError(f"prompt may hold at most {max_prompts} prompts, got "
                           f"{len(prompt)}", param="prompt")
        return list(prompt)
    return [prompt]


def prompt_truncation(body, max_model_len: int) -> int | None:
    """How many last prompt tokens ``body.truncate_prompt_tokens`` keeps (None: all;
    ``sampling_params.prompt_tokens_kept``); APIError (400 naming the field)."""
    try:
        return prompt_tokens_kept(body.truncate_prompt_tokens, max_model_len)
    except ValueError as exc:
        raise APIError(str(exc), param="truncate_prompt_tokens") from None


def completion_prompts(tokenizer, prompts: list, vocab_size: int | None, max_model_len: int,
                       keep: int | None = None) -> list[tuple[list[int], str | None]]:
    """One ``(token_ids, text)`` per prompt of :func:`prompt_list` (``text`` None for token
    ids, or text cut to its last ``keep`` tokens). APIError (400) for an empty prompt or a kept
    id out of range."""
    limit = vocab_size or len(tokenizer)
    out = []
    for p in prompts:
        if isinstance(p, str):
            if keep is None:  # a prompt to cut may be longer than the context
                check_prompt_bytes(len(p.encode("utf-8")), tokenizer, max_model_len, "prompt")
            ids, text = (tokenizer.encode(p) if p else []), p
        else:
            ids, text = list(p), None
        if not ids:
            raise APIError("prompt must not be empty", param="prompt")
        if keep is not None and len(ids) > keep:
            ids, text = ids[-keep:], None
        # ids given: checked after the cut, as vLLM does
        if not isinstance(p, str) and (bad := [t for t in ids if not 0 <= t < limit]):
            raise APIError(f"prompt token ids must be in [0, {limit}), got {bad[0]}",
                           param="prompt")
        out.append((ids, text))
    return out


# Normalizers that never shrink text by more than ``_SHRINK`` (NFC composes at most three
# code points, Hangul jamo, into one); another normalizer (StripAccents, a SentencePiece
# "Precompiled" map, ...) may delete text, and the byte bound is not used.
_SAFE_NORMALIZERS = frozenset({"Sequence", "Prepend", "NFC", "NFKC"})
_SHRINK = 4


@functools.cache
def max_bytes_per_token(tokenizer) -> int | None:
    """An upper bound of the UTF-8 bytes one token stands for (the longest vocabulary
    string's, times ``_SHRINK`` under NFC/NFKC); None when unknown. Cached per tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    normalizer = json.dumps(json.loads(backend.to_str()).get("normalizer"))
    kinds = set(re.findall(r'"type": "([^"]*)"', normalizer))
    if not kinds <= _SAFE_NORMALIZERS:
        return None
    longest = max(len(t.encode("utf-8")) for t in tokenizer.get_vocab())
    return longest * (_SHRINK if kinds - {"Sequence", "Prepend"} else 1)


def check_prompt_bytes(num_bytes: int, tokenizer, max_model_len: int, param: str) -> None:
    """OpenAI's 400 ``context_length_exceeded`` naming ``param``, before tokenizing, for text
    over ``max_model_len`` x :func:`max_bytes_per_token` bytes."""
    per_token = max_bytes_per_token(tokenizer)
    if per_token is None or num_bytes <= max_model_len * per_token:
        return
    raise APIError(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"prompt is {num_bytes} bytes, more than {max_model_len} tokens of at most "
        f"{per_token} bytes each. Please reduce the length of the prompt.",
        param=param, code="context_length_exceeded")


def check_conversation_bytes(conversation: list[dict[str, Any]], tokenizer,
                             max_model_len: int) -> None:
    """:func:`check_prompt_bytes` of the non-assistant turns (templates may drop reasoning)."""

    size = sum(len(str(m.get("content") or "").encode("utf-8")) for m in conversation
               if m["role"] != "assistant")
    check_prompt_bytes(size, tokenizer, max_model_len, "messages")

