"""Which JSON-schema keywords a structured output may use. The grammar library (xgrammar 0.2)
compiles some keywords it does not enforce; :func:`unenforced` finds them, so the request is
refused rather than its constraint silently loosened. The list was measured keyword by keyword
(a violating string accepted or not); docs/server.md, "Structured outputs", has it. Light: no
imports beyond the standard library."""

from __future__ import annotations

import json

# Keywords whose value is one subschema, a list of subschemas, or a name -> subschema map.
_ONE = ("additionalProperties", "contains", "propertyNames", "unevaluatedProperties",
        "unevaluatedItems", "items")
_LIST = ("anyOf", "oneOf", "allOf", "prefixItems", "items")  # ``items``: a list in draft 7
_MAP = ("properties", "patternProperties", "$defs", "definitions")
# Compiled and not enforced: keyword -> what to do instead.
_IGNORED = {
    "not": "it is not enforced",
    "if": "if/then/else is not enforced", "then": "if/then/else is not enforced",
    "else": "if/then/else is not enforced",
    "dependentRequired": "it is not enforced", "dependentSchemas": "it is not enforced",
    "dependencies": "it is not enforced",
}
# Bounds on a value, none of them enforced beside ``enum`` or ``const``.
_BOUNDS = ("minLength", "maxLength", "pattern", "format", "minimum", "maximum",
           "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minItems", "maxItems",
           "minProperties", "maxProperties")
# ``format`` values enforced on a ``"type": "string"`` schema.
FORMATS = frozenset((
    "email", "date", "date-time", "time", "duration", "uri", "uri-reference", "uri-template",
    "uuid", "ipv4", "ipv6", "hostname", "json-pointer", "relative-json-pointer"))


def unenforced(schema, path: str = "") -> str | None:
    """``"<path>: <why>"`` for the first keyword of ``schema`` (a JSON schema: dict or bool)
    that the grammar would accept without enforcing, else None: ``not``, ``if``/``then``/
    ``else``, ``dependentRequired``/``dependentSchemas``/``dependencies``, ``uniqueItems``
    true, ``allOf`` with more than one subschema, a ``$ref`` that is not local (``#`` or
    ``#/...``), a ``format`` outside :data:`FORMATS` or on a schema that is not a string,
    ``oneOf`` branches not provably disjoint (followed as ``anyOf``), ``minLength``/
    ``maxLength`` beside ``pattern`` or ``format`` (the length is dropped), a bound (length,
    range, pattern, format, item or property count) beside ``enum`` or ``const``, a ``required``
    property that ``additionalProperties: false`` forbids. ``path``: a JSON pointer into
    ``schema``."""
    return _walk(schema, path, schema)


def map_tag_schemas(tag, fn):
    """``tag`` (a structural tag: xgrammar's format, whose ``{"type": "json_schema",
    "json_schema": ...}`` nodes hold schemas, or vLLM's legacy ``{"structures": [{"begin",
    "schema", "end"}]}``) with ``fn`` applied to each schema in it, in document order."""
    if isinstance(tag, list):
        return [map_tag_schemas(item, fn) for item in tag]
    if not isinstance(tag, dict):
        return tag
    if tag.get("type") == "json_schema" and "json_schema" in tag:
        return {**tag, "json_schema": fn(tag["json_schema"])}
    if "schema" in tag and "begin" in tag:  # a legacy structure
        return {**tag, "schema": fn(tag["schema"])}
    return {key: map_tag_schemas(value, fn) for key, value in tag.items()}


def tag_schemas(tag) -> list:
    """The JSON schemas inside structural tag ``tag`` (:func:`map_tag_schemas`), in order."""
    found: list = []
    map_tag_schemas(tag, lambda schema: found.append(schema) or schema)
    return found


def safe_strings(schema):
    """``schema`` with each string schema (``"type"`` ``"string"`` or a list holding it) that
    bounds its length (and has no ``pattern`` or ``format``) rewritten as the same bounds on
    a pattern of characters JSON takes unescaped. xgrammar 0.2.9 follows ``minLength``/
    ``maxLength`` with a rule that admits raw control characters (U+0000-U+001F but CR and
    LF), which no JSON parser takes; it admits no escapes there either, so ``"`` and ``\\``
    stay out as before."""
    if isinstance(schema, list):
        return [safe_strings(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _ONE or key in _LIST:
            out[key] = safe_strings(value)
        elif key in _MAP and isinstance(value, dict):
            out[key] = {name: safe_strings(sub) for name, sub in value.items()}
        else:
            out[key] = value
    bounded = "minLength" in out or "maxLength" in out
    strings = "string" in (_types(out) or ())
    if strings and bounded and "pattern" not in out and "format" not in out:
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f'^[^\\x00-\\x1f"\\\\]{{{low},{high}}}$'
    return out


def _walk(s, path: str, root) -> str | None:
    if not isinstance(s, dict):
        return None
    for key, why in _IGNORED.items():
        if key in s:
            return f"{path}/{key}: {why}; leave it out"
    return _own(s, path, root) or next(
        (found for suffix, sub in _children(s) if (found := _walk(sub, path + suffix, root))),
        None)


def _children(s: dict):
    """``(JSON-pointer suffix, subschema)`` of each subschema directly in ``s``."""
    for key in _ONE:
        if isinstance(s.get(key), dict):
            yield f"/{key}", s[key]
    for key in _LIST:
        if isinstance(s.get(key), list):
            for i, sub in enumerate(s[key]):
                yield f"/{key}/{i}", sub
    for key in _MAP:
        if isinstance(s.get(key), dict):
            for name, sub in s[key].items():
                yield f"/{key}/{_escape(name)}", sub


def _own(s: dict, path: str, root) -> str | None:
    """The first unenforced keyword of ``s`` itself (not of its subschemas)."""
    if s.get("uniqueItems") is True:
        return f"{path}/uniqueItems: it is not enforced; leave it out"
    if isinstance(s.get("allOf"), list) and len(s["allOf"]) > 1:
        return (f"{path}/allOf: more than one subschema is not enforced; merge them into one "
                "schema")
    ref = s.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        return f"{path}/$ref: only local references (#/$defs/...) are followed, got {ref!r}"
    if "format" in s and (s.get("type") != "string" or s["format"] not in FORMATS):
        return (f"{path}/format: only {', '.join(sorted(FORMATS))} on a string are enforced, "
                f"got {s['format']!r}" + ("" if s.get("type") == "string" else
                                          f" on type {s.get('type')!r}") + "; leave it out")
    listed = next((k for k in ("const", "enum") if k in s), None)
    bound = next((k for k in _BOUNDS if k in s), None)
    if listed and bound:
        return (f"{path}/{bound}: not enforced beside {listed} (only its values are); list "
                "only the values it allows")
    length = next((k for k in ("minLength", "maxLength") if k in s), None)
    beside = next((k for k in ("pattern", "format") if k in s), None)
    if length and beside:
        return (f"{path}/{length}: a length beside {beside} is not enforced; "
                + ("bound the pattern's repeats instead" if beside == "pattern" else
                   "leave it out"))
    if isinstance(s.get("oneOf"), list) and not _disjoint(s["oneOf"], root):
        return (f"{path}/oneOf: branches that may overlap would be followed as anyOf; make "
                "them differ by type or by a required const property, or send anyOf")
    props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
    if s.get("additionalProperties") is False and not s.get("patternProperties"):
        for name in s.get("required") or ():
            if name not in props:
                return (f"{path}/required: {name!r} is required but additionalProperties "
                        "false forbids it: no value satisfies the schema")
    return None


def _disjoint(branches: list, root) -> bool:
    """Whether no value can match two of ``branches``: each pair differs in its types, or in
    the ``const``/``enum`` values of a property both require (local ``$ref`` resolved)."""
    resolved = [_resolve(b, root) for b in branches]
    return all(_apart(a, b) for i, a in enumerate(resolved) for b in resolved[i + 1:])


def _apart(a, b) -> bool:
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    ta, tb = _types(a), _types(b)
    if ta is not None and tb is not None and not ta & tb:
        return True
    pa, pb = a.get("properties") or {}, b.get("properties") or {}
    shared = set(a.get("required") or ()) & set(b.get("required") or ())
    return any(_values(pa.get(k)) is not None and _values(pb.get(k)) is not None
               and not _values(pa.get(k)) & _values(pb.get(k)) for k in shared)


def _types(s: dict) -> set | None:
    t = s.get("type")
    if isinstance(t, str):
        t = [t]
    if not isinstance(t, list):
        return None
    out = set(t)
    return out | {"number"} if "integer" in out else out  # an integer is a number


def _values(s) -> set | None:
    """The JSON texts ``s`` allows when it is a ``const`` or ``enum``, else None."""
    if not isinstance(s, dict):
        return None
    if "const" in s:
        return {json.dumps(s["const"], sort_keys=True)}
    if isinstance(s.get("enum"), list):
        return {json.dumps(v, sort_keys=True) for v in s["enum"]}
    return None


def _resolve(s, root, depth: int = 0):
    """``s`` with a local ``$ref`` (``#/a/b``, ``~1`` and ``~0`` escapes) followed."""
    ref = s.get("$ref") if isinstance(s, dict) else None
    if not isinstance(ref, str) or not ref.startswith("#") or depth > 16:
        return s
    target = root
    for part in filter(None, ref[1:].split("/")):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            return s
        target = target[part]
    return _resolve(target, root, depth + 1)


def _escape(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")
