"""Tool definitions and ``tool_choice``: checks, and the JSON schema a forced call is decoded
under.
Design notes: docs/internals.md, "latentserve.server.tools"."""

from __future__ import annotations

import re
from dataclasses import dataclass

from latentserve.server.errors import APIError

# OpenAI's rule for function names.
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A resolved ``tool_choice``: ``mode`` ``none``, ``auto``, ``required`` or ``named``
    (``name``); ``single``: at most one call."""

    mode: str
    name: str | None = None
    single: bool = False


def check_tools(tools: list[dict] | None,
                field=lambda i, key: f"tools[{i}].function.{key}") -> dict[str, dict]:
    """The function tools by name. APIError (400 naming ``field(i, key)``, OpenAI's name of
    field ``key`` of tool ``i`` by default) for a bad or repeated name, or ``parameters``
    that is not an object schema."""
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools or []):
        fn = tool["function"]
        name = fn["name"]
        if not _NAME.fullmatch(name):  # not match: '$' takes a final newline
            raise APIError(f"{field(i, 'name')} must be 1 to 64 letters, digits, '_' or '-', "
                           f"got {name!r}", param=field(i, "name"))
        if name in out:
            raise APIError(f"{field(i, 'name')} {name!r} is given twice",
                           param=field(i, "name"))
        schema = fn.get("parameters")
        if schema is not None and schema.get("type", "object") != "object":
            raise APIError(f"{field(i, 'parameters')} must be a JSON Schema of an object "
                           f"(type 'object'), got type {schema.get('type')!r}",
                           param=field(i, "parameters"))
        out[name] = fn
    return out


def resolve_tool_choice(choice, tools: dict[str, dict], parallel: bool | None = None
                        ) -> ToolChoice:
    """OpenAI's ``tool_choice`` (None: ``"auto"`` with tools); APIError for a bad value."""
    single = parallel is False
    if choice is None:
        return ToolChoice("auto" if tools else "none", single=single)
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise APIError("tool_choice 'required' needs tools", param="tool_choice")
        return ToolChoice(choice, single=single)
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        extra = [f"tool_choice.{k}" for k in choice if k not in ("type", "function")] + \
            [f"tool_choice.function.{k}" for k in choice["function"] if k != "name"]
        if extra:
            raise APIError(f"Unrecognized request argument supplied: {extra[0]}",
                           param=extra[0], code="unknown_field")
        name = choice["function"].get("name")
        if name not in tools:
            known = ", ".join(repr(n) for n in tools) or "none"
            raise APIError(f"tool_choice.function.name {name!r} is not one of the tools "
                           f"({known})", param="tool_choice.function.name")
        return ToolChoice("named", name, single=True)
    raise APIError("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                   f"\"function\": {{\"name\": ...}}}}, got {choice!r}", param="tool_choice")


def refuse_unenforced_strict(tools: dict[str, dict], choice: ToolChoice,
                             tool_parser: str | None,
                             field=lambda i, key: f"tools[{i}].function.{key}") -> None:
    """APIError (400 naming ``field(i, "strict")``) for a tool with ``strict: true`` under
    ``auto`` on a server without a tool-call parser (``tool_parser`` None), where nothing
    decodes the calls under their schema (with a parser the answer is decoded under its
    structural tag; ``required`` and a named function under the schema; ``none`` makes no
    call)."""
    for i, fn in enumerate(tools.values()):
        if fn.get("strict") and choice.mode == "auto" and tool_parser is None:
            raise APIError(f"{field(i, 'strict')}: strict under tool_choice 'auto' needs a "
                           "server started with --tool-call-parser; force a call ('required' "
                           "or a named function: decoded under the schema) or leave strict "
                           "out", param=field(i, "strict"))


def call_schema(choice: ToolChoice, tools: dict[str, dict]) -> dict | None:
    """The JSON schema a forced ``choice``'s answer is decoded under (else None): the named
    function's parameters, or an array of ``{"name", "parameters"}`` for ``required``."""
    if choice.mode == "named":
        return tools[choice.name].get("parameters") or EMPTY_PARAMETERS
    if choice.mode != "required":
        return None
    items = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [name]},
                             "parameters": fn.get("parameters") or EMPTY_PARAMETERS},
              "required": ["name", "parameters"]} for name, fn in tools.items()]
    return {"type": "array", "minItems": 1, "items": {"anyOf": items},
            **({"maxItems": 1} if choice.single else {})}
