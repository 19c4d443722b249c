"""JSON-schema keywords the grammar compiles without enforcing are refused
(``schema_support.unenforced``): each refused case is checked against xgrammar itself (it
accepts a string the schema forbids), and each allowed neighbour is enforced by it."""

import json
import re

import pytest

from latentserve.sampling_params import StructuredOutputsParams
from latentserve.schema_support import tag_schemas, unenforced

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
# (schema, a JSON text it forbids, what the refusal names)
REFUSED = [
    ({"type": "array", "items": {"type": "boolean"}, "uniqueItems": True}, "[true, true]",
     "/uniqueItems"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, '"a"', "/allOf"),
    ({"not": {"type": "string"}}, '"a"', "/not"),
    ({"if": {"type": "string"}, "then": {"minLength": 5}}, '"a"', "/if"),
    ({**OBJ, "dependentRequired": {"a": ["b"]}}, '{"a": 1}', "/dependentRequired"),
    ({**OBJ, "dependencies": {"a": ["b"]}}, '{"a": 1}', "/dependencies"),
    ({"type": "object", "required": ["nope"], "additionalProperties": False}, "{}",
     "/required"),
    ({"oneOf": [{"type": "integer"}, {"type": "integer", "minimum": 0}]}, "1", "/oneOf"),
    ({"type": "string", "format": "idn-email"}, '"a"', "/format"),
    ({"type": "integer", "format": "int32"}, "99999999999", "/format"),
    ({"$defs": {"x": {"$anchor": "foo", "type": "integer"}}, "$ref": "#foo"}, '"x"', "/$ref"),
    ({"type": "string", "pattern": "^a+$", "maxLength": 2}, '"aaa"', "/maxLength"),
    ({"type": "string", "enum": ["a", "bb"], "minLength": 2}, '"a"', "/minLength"),
    ({"type": "integer", "enum": [1, 50], "maximum": 10}, "50", "/maximum"),
    ({"const": "abc", "pattern": "^x"}, '"abc"', "/pattern"),
    ({"type": "string", "format": "email", "minLength": 9}, '"a@b.com"', "/minLength"),
    ({"type": "object", "properties": {"p": {"type": "array", "items": {"type": "boolean"},
                                             "uniqueItems": True}}},
     '{"p": [true, true]}', "/properties/p/uniqueItems"),
]
# Neighbours that are enforced, so they pass: (schema, a JSON text it forbids).
ENFORCED = [
    ({"type": "array", "items": {"type": "boolean"}, "uniqueItems": False, "minItems": 2},
     "[true]"),
    ({"allOf": [{"type": "integer", "minimum": 3}]}, "1"),
    ({"oneOf": [{"type": "integer"}, {"type": "string"}]}, "true"),
    ({"$defs": {"A": {"type": "object", "properties": {"k": {"const": "a"},
                                                       "x": {"type": "integer"}},
                      "required": ["k", "x"]},
                "B": {"type": "object", "properties": {"k": {"const": "b"},
                                                       "y": {"type": "integer"}},
                      "required": ["k", "y"]}},
      "oneOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]}, '{"k": "a", "y": 1}'),
    ({"type": "string", "format": "email"}, '"a"'),
    ({"type": "string", "pattern": "^a{1,2}$"}, '"aaa"'),
    ({"type": "string", "enum": ["a", "bb"], "title": "T"}, '"c"'),
    ({"type": "object", "properties": {"not": {"type": "integer"}}}, '{"not": "a"}'),
    ({**OBJ, "required": ["a"], "additionalProperties": False}, "{}"),
]


def _xgrammar_accepts(schema, text: str) -> bool:
    xgr = pytest.importorskip("xgrammar")
    from xgrammar import testing

    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False,
                                           separators=(", ", ": "), strict_mode=True)
    return testing._is_grammar_accept_string(grammar, text)


@pytest.mark.parametrize("schema,forbidden,where", REFUSED)
def test_an_unenforced_keyword_is_refused(schema, forbidden, where):
    assert _xgrammar_accepts(schema, forbidden), "xgrammar enforces it now: allow it"
    assert unenforced(schema).startswith(where + ":")
    with pytest.raises(ValueError, match=r"^response_format uses a JSON-schema keyword this "
                       r"server cannot enforce \(" + re.escape(f"{where}:")):
        StructuredOutputsParams(json=schema, param="response_format")


@pytest.mark.parametrize("schema,forbidden", ENFORCED)
def test_an_enforced_neighbour_passes(schema, forbidden):
    assert not _xgrammar_accepts(schema, forbidden)
    assert unenforced(schema) is None
    StructuredOutputsParams(json=schema)


def test_structural_tags_and_the_false_schema():
    """The schemas inside a structural tag (both forms) are checked; ``false`` is refused
    by name instead of as "none set"."""
    bad = {"type": "array", "uniqueItems": True}
    legacy = {"structures": [{"begin": "<f>", "schema": bad, "end": "</f>"}],
              "triggers": ["<f>"]}
    new = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<f>"],
           "tags": [{"type": "tag", "begin": "<f>", "end": "</f>",
                     "content": {"type": "json_schema", "json_schema": bad}}]}}
    for tag in (legacy, new):
        assert tag_schemas(tag) == [bad]
        with pytest.raises(ValueError, match="/uniqueItems"):
            StructuredOutputsParams(structural_tag=tag)
    with pytest.raises(ValueError, match="^p is the schema false, which no value satisfies"):
        StructuredOutputsParams(json=False, param="p")


def test_length_bounded_strings_keep_out_raw_control_characters():
    """xgrammar 0.2.9 follows ``minLength``/``maxLength`` with a rule that admits a raw
    U+0005, which no JSON parser takes (a sampled answer once held one); ``safe_strings``
    keeps the same bounds on characters JSON takes unescaped."""
    from latentserve.schema_support import safe_strings

    schema = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8}}}
    raw = '{"name": "__\x05 room"}'
    assert _xgrammar_accepts(schema, raw), "xgrammar keeps control characters out now"
    safe = safe_strings(schema)
    assert not _xgrammar_accepts(safe, raw)
    for text, ok in (('{"name": "Ana"}', True), ('{"name": "é日本"}', True),
                     ('{"name": ""}', False), ('{"name": "abcdefghi"}', False)):
        assert _xgrammar_accepts(safe, text) is ok and _xgrammar_accepts(schema, text) is ok
    from latentserve.schema_support import map_tag_schemas

    tag = {"type": "tag", "content": {"type": "json_schema", "json_schema": schema}}
    assert map_tag_schemas(tag, safe_strings)["content"]["json_schema"] == safe
    nullable = {"type": ["string", "null"], "maxLength": 4}
    assert _xgrammar_accepts(nullable, '"\x05"') and not _xgrammar_accepts(
        safe_strings(nullable), '"\x05"')
    for text, ok in (('"abcd"', True), ("null", True), ('"abcde"', False), ("1", False)):
        assert _xgrammar_accepts(safe_strings(nullable), text) is ok
    kept = {"type": "integer", "maxLength": 3}  # not a string: left alone
    assert safe_strings(kept) == kept and schema["properties"]["name"]["maxLength"] == 8
