"""Prompt types of the offline API, vLLM's ``TextPrompt`` and ``TokensPrompt``
(``vllm/inputs/data.py``): plain dicts, typed for readers and checkers only."""

from __future__ import annotations

from typing import NotRequired, TypedDict


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the model's tokenizer (special tokens added)."""

    prompt: str


class TokensPrompt(TypedDict):
    """A prompt of token ids (sent as they are); ``prompt`` is only echoed in
    ``RequestOutput.prompt``."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
