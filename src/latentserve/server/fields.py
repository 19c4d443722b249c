"""The body fields of each generation route, declared once: implemented, accepted with no
effect, or refused.

- implemented: the fields of the route's request model (``server/protocol.py``,
  ``server/anthropic_api.py``), validated there and used; the declaration takes them from the
  model, so validation, the OpenAPI schema and the docs table cannot disagree.
- accepted: fields of that model that are validated and change nothing in the answer
  (``user``, Anthropic's ``metadata``): ``ACCEPTED``.
- refused: fields we do not implement that would change the answer: ``REFUSED``, each with
  the values that mean "not used" (served); any other value is a 400 naming the field
  (``params.check_common``; a client must not get a 200 that ignored it). A route refuses
  the ``REFUSED`` names that are not fields of its model (chat declares ``tools``, ``echo``
  and ``chat_template``; completions declares ``echo``).

Other unknown fields are kept in ``model_extra`` and ignored, as vLLM ignores them
(``vllm/entrypoints/openai/protocol.py`` warns about them). ``NESTED`` lists the refusals
inside a field (an unknown ``structured_outputs`` key, ...), checked where the field is read.
``docs/server.md``'s field table is :func:`markdown_table` (``scripts/gen_field_table.py``).
"""

from __future__ import annotations

import functools

# Route -> (module, request model class).
ROUTES = {
    "/v1/completions": ("latentserve.server.protocol", "CompletionRequest"),
    "/v1/chat/completions": ("latentserve.server.protocol", "ChatCompletionRequest"),
    "/v1/messages": ("latentserve.server.anthropic_api", "MessagesRequest"),
}

# Fields of a route's model that are validated and change nothing in the answer.
ACCEPTED = {
    "/v1/completions": ("user",),
    "/v1/chat/completions": ("user",),
    "/v1/messages": ("metadata",),
}

# OpenAI's and vLLM's output-changing fields that are not implemented, with the values that
# mean "not used" (served); per route, those that are not fields of its model.
_OPENAI_REFUSED = {
    "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
    "tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"),
    "prompt_logprobs": (None, 0),
    "guided_decoding_backend": (None, "auto", "xgrammar"),
    "guided_whitespace_pattern": (None,),
    "prompt_embeds": (None,), "chat_template": (None,),
    "echo": (None, False), "truncate_prompt_tokens": (None,), "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0), "logits_processors": (None, []),
    "spaces_between_special_tokens": (None, True),
    "modalities": (None, ["text"]), "audio": (None,), "web_search_options": (None,),
}
REFUSED = {
    "/v1/completions": _OPENAI_REFUSED,
    "/v1/chat/completions": _OPENAI_REFUSED,
    # Anthropic's server-side tools run code on the provider's side.
    "/v1/messages": {"mcp_servers": (None, []), "container": (None,)},
}

_KEYS = "keys other than json, regex, choice, grammar and json_object"
# Refusals inside a field: (what, why), for the docs.
NESTED = {
    "/v1/completions": (
        ("structured_outputs.<key>", _KEYS),),
    "/v1/chat/completions": (
        ("structured_outputs.<key>", _KEYS),
        ("messages[i].content[j]", "parts other than text (images, audio, files)"),
        ("chat_template", "unless the server runs with --trust-request-chat-template")),
    "/v1/messages": (
        ("output_config.format", "structured outputs"),
        ("tools[i].type", "server tools (web search, code execution, ...)"),
        ("messages[i].content[j]", "image and document blocks")),
}


def request_model(route: str):
    """The pydantic request model of ``route`` (a key of ``ROUTES``)."""
    import importlib

    module, name = ROUTES[route]
    return getattr(importlib.import_module(module), name)


def implemented(route: str) -> list[str]:
    """The fields ``route`` implements: its model's fields less ``ACCEPTED``, by the names a
    client sends (aliases)."""
    fields = request_model(route).model_fields
    return [f.alias or name for name, f in fields.items() if name not in ACCEPTED[route]]


@functools.cache
def refused(route: str) -> dict[str, tuple]:
    """``REFUSED[route]`` less the fields of the route's model: name -> values served."""
    fields = request_model(route).model_fields
    return {k: v for k, v in REFUSED[route].items() if k not in fields}


def route_of(model: type) -> str:
    """The route whose request model is ``model`` or one of its bases (``/v1/completions``
    for a model of no route)."""
    for route, (_, name) in ROUTES.items():
        if any(cls.__name__ == name for cls in model.__mro__):
            return route
    return "/v1/completions"


def markdown_table() -> str:
    """The docs table: one row per route, its implemented, accepted and refused fields
    (refused ones with the values that are served, then ``NESTED``)."""

    def code(names) -> str:
        return ", ".join(f"`{n}`" for n in names)

    def served(values: tuple) -> str:
        import json

        return "/".join("null" if v is None else json.dumps(v) for v in values)

    head = ("| route | implemented | accepted, no effect | refused: a 400 naming the field "
            "(values served) |")
    rows = [head, "|---|---|---|---|"]
    for route in ROUTES:
        out = [f"`{k}` ({served(v)})" for k, v in sorted(refused(route).items())]
        out += [f"`{what}`: {why}" for what, why in NESTED[route]]
        rows.append(f"| `{route}` | {code(sorted(implemented(route)))} | "
                    f"{code(ACCEPTED[route])} | {'; '.join(out)} |")
    return "\n".join(rows) + "\n"


TABLE_BEGIN = "<!-- field table: generated by scripts/gen_field_table.py, do not edit -->"
TABLE_END = "<!-- end of field table -->"


def with_table(doc: str) -> str:
    """``doc`` with the text between ``TABLE_BEGIN`` and ``TABLE_END`` replaced by
    :func:`markdown_table`. Raises ValueError when a marker is missing."""
    if TABLE_BEGIN not in doc or TABLE_END not in doc:
        raise ValueError(f"the doc has no {TABLE_BEGIN!r} ... {TABLE_END!r} markers")
    head, rest = doc.split(TABLE_BEGIN, 1)
    _, tail = rest.split(TABLE_END, 1)
    return f"{head}{TABLE_BEGIN}\n{markdown_table()}{TABLE_END}{tail}"
