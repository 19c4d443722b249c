"""Anthropic Messages content blocks and tools <-> the chat template's conversation and the
OpenAI-shaped tools of ``server/tools.py``.
Design notes: docs/internals.md, "latentserve.server.anthropic_blocks"."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from latentserve.server.errors import APIError
from latentserve.server.protocol import RequestModel
from latentserve.server.tools import ToolChoice, check_tools


class ContentBlock(RequestModel):
    """One block of a message's content; which fields a block has depends on its type."""

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # thinking
    signature: str | None = None


class AnthropicTool(RequestModel):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class AnthropicThinking(RequestModel):
    """``thinking``: ``type`` is checked by ``anthropic_api.thinking_flag``; ``budget_tokens``
    (an integer >= 1024, as Anthropic's API requires; not held below ``max_tokens``) is the
    engine's ``thinking_token_budget``."""

    type: str | None = None
    budget_tokens: int | None = Field(None, ge=1024)


class AnthropicToolChoice(RequestModel):
    """``tool_choice``: ``type`` is checked by :func:`anthropic_tool_choice`."""

    type: str | None = None
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


def _text(block: ContentBlock, param: str) -> str:
    if block.text is None:
        raise APIError(f"{param}.text: a text block needs a string 'text'", param=f"{param}.text")
    return block.text


def _result_text(block: ContentBlock, param: str) -> str:
    """A ``tool_result``'s content as text (a string or text blocks)."""
    content = block.content
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for k, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise APIError(f"{param}.content.{k}: only text blocks are supported in a "
                           f"tool_result, got type {part.get('type')!r}",
                           param=f"{param}.content.{k}")
        parts.append(part["text"])
    return "".join(parts)


def message_turns(role: str, content: str | list[ContentBlock], param: str,
                  tool_names: dict[str, str]) -> list[dict[str, Any]]:
    """One Anthropic message as chat-template turns (``tool_names``: tool_use id -> name).
    APIError (400 naming ``{param}.{j}``) for another block type or missing fields."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        where = f"{param}.{j}"
        kind = block.type
        if kind == "text":
            texts.append(_text(block, where))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        elif kind == "tool_use" and role == "assistant":
            if block.id is None or block.name is None:
                raise APIError(f"{where}: a tool_use block needs 'id' and 'name'", param=where)
            tool_names[block.id] = block.name
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input or {}}})
        elif kind == "tool_result" and role == "user":
            if block.tool_use_id is None:
                raise APIError(f"{where}.tool_use_id: a tool_result block needs it",
                               param=f"{where}.tool_use_id")
            turn = {"role": "tool", "tool_call_id": block.tool_use_id,
                    "content": _result_text(block, where)}
            if block.tool_use_id in tool_names:
                turn["name"] = tool_names[block.tool_use_id]
            if block.is_error:
                turn["is_error"] = True
            results.append(turn)
        else:
            allowed = ("text, thinking, tool_use" if role == "assistant"
                       else "text, tool_result")
            raise APIError(f"{where}: {role} content blocks may be {allowed}; got type "
                           f"{kind!r}", param=where)
    turns = results
    if texts or calls or not results:
        turn = {"role": role, "content": "".join(texts)}
        if calls:
            turn["tool_calls"] = calls
        turns = [*results, turn]
    return turns


def openai_tools(tools: list[AnthropicTool] | None) -> list[dict[str, Any]] | None:
    """Anthropic tools as OpenAI function tools; APIError for a server tool, schema or name."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise APIError(f"tools.{i}.type: server tools are not supported by this server, "
                           f"got {tool.type!r}", param=f"tools.{i}.type")
        if tool.input_schema is None:
            raise APIError(f"tools.{i}.input_schema: Field required",
                           param=f"tools.{i}.input_schema")
        fn = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            fn["description"] = tool.description
        out.append({"type": "function", "function": fn})
    check_tools(out, lambda i, key: f"tools.{i}.{'input_schema' if key == 'parameters' else key}")
    return out


def anthropic_tool_choice(choice: AnthropicToolChoice | None, tools: dict[str, dict]
                          ) -> ToolChoice:
    """Anthropic's ``tool_choice`` (None: ``auto`` with tools); APIError for a bad value."""

    if choice is None:
        return ToolChoice("auto" if tools else "none")
    kind = choice.type
    single = choice.disable_parallel_tool_use is True
    if kind in ("auto", "none"):
        return ToolChoice(kind, single=single)
    if kind in ("any", "tool") and not tools:
        raise APIError(f"tool_choice: type {kind!r} needs tools", param="tool_choice")
    if kind == "any":
        return ToolChoice("required", single=single)
    if kind == "tool":
        name = choice.name
        if name not in tools:
            raise APIError(f"tool_choice.name: {name!r} is not one of the tools "
                           f"({', '.join(repr(n) for n in tools)})", param="tool_choice.name")
        return ToolChoice("named", name, single=True)
    raise APIError(f"tool_choice.type: must be 'auto', 'any', 'tool' or 'none', got {kind!r}",
                   param="tool_choice.type")
