"""Prompts -> token ids: chat templates for chat, plain encoding for completions."""

from __future__ import annotations

from typing import Any

from latentserve.server.errors import APIError
from latentserve.server.params import context_error
from latentserve.server.protocol import ChatMessage

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")

# Arguments of apply_chat_template that a client may not set through chat_template_kwargs.
_RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tokenize", "return_dict", "return_tensors", "tools",
    "documents", "chat_template", "padding", "truncation", "max_length",
    "return_assistant_tokens_mask", "tokenizer_kwargs",
})


def chat_conversation(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """OpenAI messages -> ``[{"role", "content"}]`` for the chat template.

    Raises:
        APIError: 400 for no user turn, an unknown role or non-text content.
    """
    conversation = []
    for i, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise APIError(f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got "
                           f"{message.role!r}", param=f"messages[{i}].role")
        conversation.append({"role": message.role, "content": _text(message, i)})
    if not any(m["role"] == "user" for m in conversation):
        raise APIError("messages must contain at least one message with role 'user'",
                       param="messages")
    return conversation


def render_chat(tokenizer, conversation: list[dict[str, str]], *,
                add_generation_prompt: bool = True, continue_final_message: bool = False,
                template_kwargs: dict[str, Any] | None = None,
                param: str = "messages") -> list[int]:
    """Apply the tokenizer's chat template and return the prompt's token ids.

    ``continue_final_message`` leaves the last (assistant) message open so the model
    continues it (and turns ``add_generation_prompt`` off). ``template_kwargs`` are passed to
    the template (they may override the two flags; other ``apply_chat_template`` arguments
    are refused).

    Raises:
        APIError: 400 for a model without tokenizer files or a chat template, a reserved
            or non-string template keyword, ``continue_final_message`` without a final
            assistant message, or a template that fails on this conversation.
    """
    from latentserve.models.checkpoint import NO_TOKENIZER, NoTokenizer

    if isinstance(tokenizer, NoTokenizer):
        raise APIError(f"{NO_TOKENIZER} to /v1/completions", param=param)
    if not getattr(tokenizer, "chat_template", None):
        raise APIError("this model's tokenizer has no chat template; use /v1/completions",
                       param=param)
    kwargs: dict[str, Any] = {"add_generation_prompt": add_generation_prompt,
                              "continue_final_message": continue_final_message}
    for key, value in (template_kwargs or {}).items():
        if key in _RESERVED_TEMPLATE_KWARGS:
            raise APIError(f"chat_template_kwargs may not set {key!r}",
                           param="chat_template_kwargs")
        kwargs[key] = value
    if kwargs["continue_final_message"]:
        if not conversation or conversation[-1]["role"] != "assistant":
            raise APIError("continue_final_message needs a final message with role "
                           "'assistant'", param="continue_final_message")
        kwargs["add_generation_prompt"] = False
    try:
        out = tokenizer.apply_chat_template(conversation, **kwargs)
    except APIError:
        raise
    except Exception as exc:  # noqa: BLE001 - jinja errors, template raise_exception(...)
        raise APIError(f"the chat template failed on these messages: "
                       f"{type(exc).__name__}: {exc}", param=param) from None
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def chat_prompt_ids(tokenizer, messages: list[ChatMessage], **kwargs) -> list[int]:
    """:func:`chat_conversation` then :func:`render_chat` (``kwargs`` go to the latter)."""
    return render_chat(tokenizer, chat_conversation(messages), **kwargs)


def _text(message: ChatMessage, i: int) -> str:
    content = message.content
    if content is None:
        if message.role in ("user", "system"):
            raise APIError(f"a {message.role} message needs content (a string or a list of "
                           "text parts), got null", param=f"messages[{i}].content")
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise APIError(f"only text content parts are supported, got type {part.type!r}",
                           param=f"messages[{i}].content[{j}]")
        if part.text is None:
            raise APIError("a text content part needs a string 'text'",
                           param=f"messages[{i}].content[{j}].text")
        texts.append(part.text)
    return "".join(texts)


def completion_prompts(tokenizer, prompt, vocab_size: int | None, max_prompts: int
                       ) -> list[tuple[list[int], str | None]]:
    """Encode a completions ``prompt``: a string, token ids, or a list of either.

    Returns one ``(token_ids, text)`` per prompt (``text`` None for a token-id prompt).

    Raises:
        APIError: 400 for an empty prompt (or list), more than ``max_prompts`` prompts, or a
            token id out of range.
    """
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompts = list(prompt)
        if len(prompts) > max_prompts:
            raise APIError(f"prompt may hold at most {max_prompts} prompts, got "
                           f"{len(prompts)}", param="prompt")
    else:
        prompts = [prompt]
    limit = vocab_size or len(tokenizer)
    out = []
    for p in prompts:
        if isinstance(p, str):
            ids, text = (tokenizer.encode(p) if p else []), p
        else:
            ids, text = list(p), None
            bad = [t for t in ids if not 0 <= t < limit]
            if bad:
                raise APIError(f"prompt token ids must be in [0, {limit}), got {bad[0]}",
                               param="prompt")
        if not ids:
            raise APIError("prompt must not be empty", param="prompt")
        out.append((ids, text))
    return out


def check_prompt_length(num_prompt_tokens: int, max_model_len: int, param: str) -> None:
    """The prompt must leave room for at least one generated token (else the OpenAI
    "maximum context length" 400, ``code="context_length_exceeded"``)."""
    if num_prompt_tokens >= max_model_len:
        raise context_error(num_prompt_tokens, max_model_len, param)
