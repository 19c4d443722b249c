"""Prompts -> token ids: chat templates for chat, plain encoding for completions."""

from __future__ import annotations

from latentserve.server.errors import APIError
from latentserve.server.protocol import ChatMessage

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_prompt_ids(tokenizer, messages: list[ChatMessage]) -> list[int]:
    """Apply the tokenizer's chat template (with the generation prompt).

    Raises:
        APIError: 400 for no user turn, an unknown role, non-text content, or a model
            without a chat template.
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
    if not getattr(tokenizer, "chat_template", None):
        raise APIError("this model's tokenizer has no chat template; use /v1/completions",
                       param="messages")
    out = tokenizer.apply_chat_template(conversation, add_generation_prompt=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _text(message: ChatMessage, i: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise APIError(f"only text content parts are supported, got type {part.type!r}",
                           param=f"messages[{i}].content[{j}]")
        texts.append(part.text)
    return "".join(texts)


def completion_prompt_ids(tokenizer, prompt, vocab_size: int | None) -> list[int]:
    """Encode a completions ``prompt`` (string, one-string list, ids, or one-id-list list).

    Raises:
        APIError: 400 for an empty prompt, several prompts, or a token id out of range.
    """
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) > 1:
            raise APIError(f"prompt must be a single prompt; got a list of {len(prompt)} "
                           "(batched prompts are not supported yet)", param="prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt) if prompt else []
    else:
        ids = list(prompt)
        limit = vocab_size or len(tokenizer)
        bad = [t for t in ids if not 0 <= t < limit]
        if bad:
            raise APIError(f"prompt token ids must be in [0, {limit}), got {bad[0]}",
                           param="prompt")
    if not ids:
        raise APIError("prompt must not be empty", param="prompt")
    return ids


def check_prompt_length(num_prompt_tokens: int, max_model_len: int, param: str) -> None:
    """The prompt must leave room for at least one generated token."""
    if num_prompt_tokens >= max_model_len:
        raise APIError(f"the prompt has {num_prompt_tokens} tokens but max_model_len is "
                       f"{max_model_len}; it must be shorter to leave room for at least one "
                       "generated token", param=param, code="context_length_exceeded")
