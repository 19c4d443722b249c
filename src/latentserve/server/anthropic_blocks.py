"""Anthropic Messages content blocks and tools <-> the chat template's conversation and the
OpenAI-shaped tools of ``server/tools.py``.
Design notes: docs/internals.md, "latentserve.server.anthropic_blocks"."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from latentserve.server.errors import APIError, short_repr
from latentserve.server.protocol import RequestModel
from latentserve.server.tools import ToolChoice, check_tools


class ContentBlock(RequestModel):
    """One block of a message's content; which keys a block takes depends on its type
    (``cache_control``, a caching hint checked by :func:`refuse_bad_cache_control`, has no
    effect; ``thinking`` blocks are dropped)."""

    TYPE_KEYS = {
        "text": ("type", "text", "cache_control"),
        "thinking": ("type", "thinking", "signature"),
        "redacted_thinking": ("type", "data"),
        "tool_use": ("type", "id", "name", "input", "cache_control"),
        "tool_result": ("type", "tool_use_id", "content", "is_error", "cache_control"),
    }
    UNUSED = {"citations": (None, []), "caller": (None,), "toolset_name": (None,)}

    type: str
    text: str | None = None
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[ContentBlock] | None = None  # text blocks
    is_error: bool | None = None
    thinking: str | None = None  # thinking
    signature: str | None = None
    data: str | None = None  # redacted_thinking
    cache_control: dict[str, Any] | None = None


_CUSTOM_TOOL = ("name", "description", "input_schema", "type", "cache_control", "strict")


class AnthropicTool(RequestModel):
    """A client tool (``type`` null or ``custom``; server tools are refused by type);
    ``strict`` as OpenAI's (``tools.refuse_unenforced_strict``)."""

    TYPE_KEYS = {None: _CUSTOM_TOOL, "custom": _CUSTOM_TOOL}
    UNUSED = {"allowed_callers": (None, []), "defer_loading": (None, False),
              "eager_input_streaming": (None, False), "input_examples": (None, [])}

    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None
    cache_control: dict[str, Any] | None = None
    strict: bool | None = None


class AnthropicThinking(RequestModel):
    """``thinking``: ``type`` is checked by ``anthropic_api._prompt``; ``budget_tokens``
    (an integer >= 1024, as Anthropic's API requires; not held below ``max_tokens``) is the
    engine's ``thinking_token_budget``."""

    UNUSED = {"display": (None,)}

    type: str | None = None
    budget_tokens: int | None = Field(None, ge=1024)


class AnthropicToolChoice(RequestModel):
    """``tool_choice``; ``type`` -> ``ToolChoice`` mode by ``_CHOICE_MODES``."""

    TYPE_KEYS = {"auto": ("type", "disable_parallel_tool_use"),
                 "any": ("type", "disable_parallel_tool_use"),
                 "tool": ("type", "name", "disable_parallel_tool_use"), "none": ("type",)}

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class AnthropicMetadata(RequestModel):
    """``metadata``: ``user_id`` has no effect."""

    user_id: str | None = None


CACHE_TTLS = ("5m", "1h")


def refuse_bad_cache_control(value, path: str) -> None:
    """APIError (400 naming the path) for a ``cache_control`` in ``value`` (a request body or
    an object or list in it, at ``path``; "" for the body) other than Anthropic's
    ``{"type": "ephemeral"}`` with an optional ``ttl`` of ``CACHE_TTLS``. The hint is taken
    and has no effect: prompt caching here is the radix cache's, automatic."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            refuse_bad_cache_control(item, f"{path}.{i}")
        return
    if not isinstance(value, RequestModel):
        return
    for name in type(value).model_fields:
        here = f"{path}.{name}" if path else name
        if name == "cache_control":
            _check_cache_control(getattr(value, name), here)
        else:
            refuse_bad_cache_control(getattr(value, name), here)


def _check_cache_control(control: dict[str, Any] | None, path: str) -> None:
    """APIError (400 naming ``path`` or its key) unless ``control`` is None or ephemeral."""
    if control is None:
        return
    if control.get("type") != "ephemeral":
        raise APIError(f"{path}.type: Input should be 'ephemeral' (got "
                       f"{short_repr(control.get('type'))})", param=f"{path}.type")
    ttl = control.get("ttl")
    if ttl is not None and ttl not in CACHE_TTLS:
        raise APIError(f"{path}.ttl: Input should be '5m' or '1h' (got {short_repr(ttl)})",
                       param=f"{path}.ttl")
    extra = sorted(control.keys() - {"type", "ttl"})
    if extra:
        raise APIError(f"Unrecognized request argument supplied: {path}.{extra[0]}",
                       param=f"{path}.{extra[0]}", code="unknown_field")


def _result_text(block: ContentBlock, param: str) -> str:
    """A ``tool_result``'s content as text (a string or text blocks)."""
    if not isinstance(block.content, list):
        return block.content or ""
    for k, part in enumerate(block.content):
        if part.type != "text" or part.text is None:
            raise APIError(f"{param}.content.{k}: only text blocks are supported in a "
                           f"tool_result, got type {part.type!r}",
                           param=f"{param}.content.{k}")
    return "\n".join(part.text or "" for part in block.content)


_ALLOWED_BLOCKS = {"assistant": "text, thinking, tool_use", "user": "text, tool_result"}


def message_turns(role: str, content: str | list[ContentBlock], param: str,
                  answerable: dict[str, str]) -> list[dict[str, Any]]:
    """One Anthropic message (or ``system``) as chat-template turns (``answerable``: tool_use
    id -> name, of the previous message). APIError (400 naming ``{param}.{j}``) for another
    block type, a missing field, an empty text block or a ``tool_result`` whose
    ``tool_use_id`` the previous message's ``tool_use`` blocks lack (as Anthropic's API)."""
    if isinstance(content, str):
        return [{"role": role, "content": content}]
    texts, calls, results = [], [], []
    for j, block in enumerate(content):
        where = f"{param}.{j}"
        kind = block.type
        if kind == "text":
            if block.text is None:
                raise APIError(f"{where}.text: a text block needs a string 'text'",
                               param=f"{where}.text")
            if not block.text:
                raise APIError(f"{where}.text: text content blocks must be non-empty",
                               param=f"{where}.text")
            texts.append(block.text)
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            continue
        elif kind == "tool_use" and role == "assistant":
            if block.id is None or block.name is None:
                raise APIError(f"{where}: a tool_use block needs 'id' and 'name'", param=where)
            calls.append({"id": block.id, "type": "function",
                          "function": {"name": block.name, "arguments": block.input or {}}})
        elif kind == "tool_result" and role == "user":
            if block.tool_use_id is None:
                raise APIError(f"{where}.tool_use_id: a tool_result block needs it",
                               param=f"{where}.tool_use_id")
            if block.tool_use_id not in answerable:  # as Anthropic's API
                raise APIError(f"{where}.tool_use_id: unexpected `tool_use_id` found in "
                               f"`tool_result` blocks: {block.tool_use_id}. Each `tool_result` "
                               "block must have a corresponding `tool_use` block in the "
                               "previous message",
                               param=f"{where}.tool_use_id")
            turn = {"role": "tool", "tool_call_id": block.tool_use_id,
                    "content": _result_text(block, where), "name": answerable[block.tool_use_id]}
            if block.is_error:
                turn["is_error"] = True
            results.append(turn)
        else:
            allowed = _ALLOWED_BLOCKS.get(role, "text")
            raise APIError(f"{where}: {role} content blocks may be {allowed}; got type "
                           f"{kind!r}", param=where)
    if results and not (texts or calls):
        return results
    # text blocks as vLLM joins them: a line each, the system prompt's run together
    turn = {"role": role, "content": ("" if role == "system" else "\n").join(texts)}
    if calls:
        turn["tool_calls"] = calls
    return [*results, turn]


def openai_tools(tools: list[AnthropicTool] | None
                 ) -> tuple[list[dict[str, Any]] | None, dict[str, dict]]:
    """Anthropic tools as OpenAI function tools (None: none) and ``tools.check_tools``' dict
    of them by name; APIError (400 naming the field) for a server tool, schema or name."""
    if not tools:
        return None, {}
    out = []
    for i, tool in enumerate(tools):
        if tool.type not in (None, "custom"):
            raise APIError(f"tools.{i}.type: server tools are not supported by this server, "
                           f"got {tool.type!r}", param=f"tools.{i}.type")
        if tool.input_schema is None:
            raise APIError(f"tools.{i}.input_schema: Field required",
                           param=f"tools.{i}.input_schema")
        fn = {"name": tool.name, "parameters": tool.input_schema}
        fn |= {k: v for k in ("description", "strict") if (v := getattr(tool, k)) is not None}
        out.append({"type": "function", "function": fn})
    return out, check_tools(out, tool_field)


def tool_field(i: int, key: str) -> str:
    """Anthropic's name of field ``key`` (OpenAI's name: ``parameters`` is ``input_schema``)
    of tool ``i``."""
    return f"tools.{i}.{'input_schema' if key == 'parameters' else key}"


# Anthropic's tool_choice type -> ToolChoice mode.
_CHOICE_MODES = {"auto": "auto", "none": "none", "any": "required", "tool": "named"}


def anthropic_tool_choice(choice: AnthropicToolChoice | None, tools: dict[str, dict]
                          ) -> ToolChoice:
    """Anthropic's ``tool_choice`` (None: ``auto`` with tools); APIError for a bad value."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    kind, mode = choice.type, _CHOICE_MODES[choice.type]
    if mode in ("required", "named") and not tools:
        raise APIError(f"tool_choice: type {kind!r} needs tools", param="tool_choice")
    if mode == "named" and choice.name not in tools:
        raise APIError(f"tool_choice.name: {choice.name!r} is not one of the tools "
                       f"({', '.join(repr(n) for n in tools)})", param="tool_choice.name")
    return ToolChoice(mode, choice.name if mode == "named" else None,
                      single=mode == "named" or choice.disable_parallel_tool_use is True)
