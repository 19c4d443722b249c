"""Tool definitions and ``tool_choice``: checks, the JSON schema a forced call is decoded
under, and the constraint that carries it to the engine.
Design notes: docs/internals.md, "latentserve.server.tools"."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from latentserve.sampling_params import StructuredOutputsParams
from latentserve.server.errors import APIError

# OpenAI's rule for function names.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
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
        if not _NAME.match(name):
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


def resolve_tool_choice(choice, tools: dict[str, dict], parallel: bool | None = None,
                        param: str = "tool_choice") -> ToolChoice:
    """OpenAI's ``tool_choice`` (None: ``"auto"`` with tools); APIError for a bad value."""
    single = parallel is False
    if choice is None:
        return ToolChoice("auto" if tools else "none", single=single)
    if choice in ("none", "auto", "required"):
        if choice == "required" and not tools:
            raise APIError(f"{param} 'required' needs tools", param=param)
        return ToolChoice(choice, single=single)
    if isinstance(choice, dict) and choice.get("type") == "function" \
            and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in tools:
            known = ", ".join(repr(n) for n in tools) or "none"
            raise APIError(f"{param}.function.name {name!r} is not one of the tools "
                           f"({known})", param=f"{param}.function.name")
        return ToolChoice("named", name, single=True)
    raise APIError(f"{param} must be 'none', 'auto', 'required' or {{\"type\": \"function\", "
                   f"\"function\": {{\"name\": ...}}}}, got {choice!r}", param=param)


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
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if choice.single:
        schema["maxItems"] = 1
    return schema


def json_constraint(params, schema: dict, param: str = "tool_choice"):
    """``params`` constrained to JSON matching ``schema``; APIError (400 naming ``param``)."""
    if params.structured_outputs is not None:
        raise APIError(f"{param}: a forced tool call is decoded under its own JSON schema; it "
                       f"cannot be combined with {params.structured_outputs.param}",
                       param=param)
    try:
        return dataclasses.replace(
            params, structured_outputs=StructuredOutputsParams(json=schema, param=param))
    except (TypeError, ValueError) as exc:
        raise APIError(f"{param}: {exc}", param=param) from None
