"""Structured output: JSON Schema -> GBNF (appliance.engine.structured), every grammar checked by llama.cpp's own
parser and sampler (tests/grammar_check.py), every refusal a P4 BAD_REQUEST naming the keyword and its path."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from grammar_check import GrammarCheck
from vendored import vocab_path

from appliance.engine import structured
from appliance.errors import ApplianceError


@pytest.fixture(scope="module")
def check(vendored: Path) -> Iterator[GrammarCheck]:
    checker = GrammarCheck(vocab_path(vendored, "llama-bpe"))
    yield checker
    checker.close()


OBJECT_AB = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "required": ["a"]}
TREE = {"$defs": {"node": {"type": "object", "properties": {
    "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}, "required": ["v"]}},
    "$ref": "#/$defs/node"}

# (what, schema, valid instances, invalid JSON texts or instances)
ACCEPTED: list[tuple[str, dict[str, Any], list[Any], list[Any]]] = [
    ("string", {"type": "string"}, ["abc", "", "é ü"], [5, None]),
    ("integer", {"type": "integer"}, [42, -3, 0], [1.5, "1"]),
    ("number", {"type": "number"}, [1.5, -2, 3e5], ["x", True]),
    ("boolean", {"type": "boolean"}, [True, False], [1, "true"]),
    ("null", {"type": "null"}, [None], [0, ""]),
    ("type list", {"type": ["string", "null"]}, ["a", None], [1, []]),
    ("properties, required", OBJECT_AB, [{"a": "x"}, {"a": "x", "b": 2}], [{}, {"a": 1}, {"b": 2}]),
    ("additionalProperties false", {**OBJECT_AB, "additionalProperties": False}, [{"a": "x"}],
     [{"a": "x", "c": 1}]),
    ("additionalProperties schema", {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
                                     "additionalProperties": {"type": "integer"}},
     [{"a": "x"}, {"a": "x", "n": 2}], [{"a": "x", "n": "s"}]),
    ("items", {"type": "array", "items": {"type": "integer"}}, [[], [1, 2]], [["a"], {}]),
    ("minItems, maxItems", {"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 2},
     [[1], [1, 2]], [[], [1, 2, 3]]),
    ("prefixItems", {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}]}, [[1, "a"]],
     [["a", 1]]),
    ("items as a list", {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
                         "items": [{"type": "integer"}, {"type": "string"}]}, [[1, "a"]],
     [["a", 1]]),
    ("minLength, maxLength", {"type": "string", "minLength": 2, "maxLength": 3}, ["ab", "abc"], ["a", "abcd"]),
    ("pattern", {"type": "string", "pattern": "^[a-z]+\\d{2}$"}, ["ab12", "x00"], ["ab1", "AB12", "ab123"]),
    ("pattern with . and a range", {"type": "string", "pattern": "^a.c[ -~]$"}, ["abc!", "a c~"],
     ['"a\\"c!"', '"abc\\\\"', "abcé"]),  # . and ranges spell no raw quote or backslash
    ("pattern alternation", {"type": "string", "pattern": "^(cat|dog)s?$"}, ["cat", "dogs"], ["cow", "cats!"]),
    ("pattern escapes", {"type": "string", "pattern": "^\\$\\.\\w+-\\x41$"}, ["$.ab_9-A"], ["$xab-A"]),
    ("format date", {"type": "string", "format": "date"}, ["2024-01-31"], ["2024-13-01", "24-01-01"]),
    ("format time", {"type": "string", "format": "time"}, ["12:30:59Z", "23:00:00+01:00"], ["25:00:00Z"]),
    ("format date-time", {"type": "string", "format": "date-time"}, ["2024-01-31T12:30:59Z"], ["2024-01-31"]),
    ("format uuid", {"type": "string", "format": "uuid"}, ["123e4567-e89b-12d3-a456-426614174000"], ["123"]),
    ("enum", {"enum": ["red", "green", 3]}, ["red", 3], ["blue", 4]),
    ("const", {"const": {"k": [1, "x"]}}, [{"k": [1, "x"]}], [{"k": [1]}]),
    ("anyOf", {"anyOf": [{"type": "string"}, {"type": "integer"}]}, ["a", 3], [True, None]),
    ("$ref, recursive", TREE, [{"v": 1}, {"v": 1, "kids": [{"v": 2, "kids": []}]}], [{"kids": []}]),
    ("$ref to definitions named as other rules", {"type": "object", "properties": {
        "x": {"type": "object", "properties": {"v": {"type": "integer"}}}, "y": {"$ref": "#/$defs/x"},
        "sp": {"$ref": "#/definitions/space"}, "p": {"$ref": "#/properties/x"}},
        "$defs": {"x": {"type": "string"}}, "definitions": {"space": {"type": "boolean"}}},
     [{"x": {"v": 1}, "y": "s", "sp": True, "p": {"v": 2}}], [{"y": 1}, {"sp": "s"}, {"p": "s"}]),
    ("a root $ref beside its definitions", {"$defs": {"s": {"type": "string", "maxLength": 2}}, "$ref": "#/$defs/s"},
     ["ab"], ["abc"]),
    ("annotations", {"type": "string", "title": "t", "description": "d", "default": "x", "examples": ["a"],
                     "$comment": "c", "x-vendor": 1}, ["a"], [1]),
    ("empty schema: any object", {}, [{"a": [1, {"b": None}]}, {}], ["s", [1]]),
    ("annotations only: any object", {"description": "anything"}, [{"a": 1}], [1]),
]


def as_text(instance: Any) -> str:
    """An instance as the JSON text a grammar is fed (strings in the table that start with a quote are texts)."""
    if isinstance(instance, str) and instance.startswith('"'):
        return instance
    return json.dumps(instance, ensure_ascii=False)


@pytest.mark.parametrize(("what", "schema", "valid", "invalid"), ACCEPTED, ids=[case[0] for case in ACCEPTED])
def test_each_supported_keyword_is_enforced(check: GrammarCheck, what: str, schema: dict[str, Any],
                                            valid: list[Any], invalid: list[Any]) -> None:
    grammar = structured.schema_grammar(schema, "response_format.json_schema.schema")
    for instance in valid:
        assert check.accepts(grammar, as_text(instance)), f"{what}: {as_text(instance)} refused"
    for instance in invalid:
        assert not check.accepts(grammar, as_text(instance)), f"{what}: {as_text(instance)} accepted"


@pytest.mark.parametrize(("what", "schema", "valid", "invalid"), ACCEPTED, ids=[case[0] for case in ACCEPTED])
def test_the_tables_valid_instances_are_valid_json_schema_instances(what: str, schema: dict[str, Any],
                                                                    valid: list[Any], invalid: list[Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    for instance in valid:
        jsonschema.validate(instance, schema)


# (what, schema, the keyword named, its path)
REFUSED: list[tuple[str, Any, str | None, str]] = [
    ("minimum", {"type": "integer", "minimum": 1}, "minimum", "/"),
    ("maximum, nested", {"type": "object", "properties": {"a": {"type": "number", "maximum": 3}}}, "maximum",
     "/properties/a"),
    ("exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, "exclusiveMinimum", "/"),
    ("exclusiveMaximum", {"type": "number", "exclusiveMaximum": 0}, "exclusiveMaximum", "/"),
    ("multipleOf", {"type": "integer", "multipleOf": 2}, "multipleOf", "/"),
    ("minProperties", {"type": "object", "minProperties": 1}, "minProperties", "/"),
    ("maxProperties", {"type": "object", "maxProperties": 1}, "maxProperties", "/"),
    ("patternProperties", {"type": "object", "patternProperties": {"^a": {}}}, "patternProperties", "/"),
    ("propertyNames", {"type": "object", "propertyNames": {"maxLength": 3}}, "propertyNames", "/"),
    ("dependentRequired", {"type": "object", "dependentRequired": {"a": ["b"]}}, "dependentRequired", "/"),
    ("uniqueItems", {"type": "array", "items": {}, "uniqueItems": True}, "uniqueItems", "/"),
    ("contains", {"type": "array", "contains": {"type": "integer"}}, "contains", "/"),
    ("allOf", {"allOf": [{"type": "object"}]}, "allOf", "/"),
    ("oneOf", {"oneOf": [{"type": "string"}, {"type": "integer"}]}, "oneOf", "/"),
    ("not", {"not": {"type": "string"}}, "not", "/"),
    ("if", {"if": {"type": "string"}, "then": {"minLength": 1}}, "if", "/"),
    ("nullable", {"type": "string", "nullable": True}, "nullable", "/"),
    ("an unknown format", {"type": "string", "format": "email"}, "format", "/"),
    ("an unknown type", {"type": "date"}, "type", "/"),
    ("a remote $ref", {"$ref": "https://example.com/s.json"}, "$ref", "/"),
    ("a $ref to nothing", {"$defs": {}, "$ref": "#/$defs/nope"}, "$ref", "/"),
    ("a $ref to a non-schema", {"type": "object", "properties": {"a": {"$ref": "#/properties"}}}, "$ref",
     "/properties/a"),
    ("a constraint beside $ref", {"$defs": {"s": {"type": "string"}}, "$ref": "#/$defs/s", "maxLength": 3},
     "maxLength", "/"),
    ("type beside anyOf", {"type": "string", "anyOf": [{"maxLength": 2}]}, "type", "/"),
    ("a constraint beside a type list", {"type": ["string", "null"], "maxLength": 2}, "maxLength", "/"),
    ("an enum value of another type", {"type": "string", "enum": ["a", 1]}, "enum", "/"),
    ("minLength without type", {"minLength": 2}, "minLength", "/"),
    ("minLength beside pattern", {"type": "string", "pattern": "^a+$", "minLength": 2}, "minLength", "/"),
    ("maxLength beside format", {"type": "string", "format": "date", "maxLength": 2}, "maxLength", "/"),
    ("minItems without items", {"type": "array", "minItems": 1}, "minItems", "/"),
    ("maxItems with a tuple", {"type": "array", "prefixItems": [{}], "maxItems": 1}, "maxItems", "/"),
    ("required not in properties", {"type": "object", "properties": {}, "required": ["a"]}, "required", "/"),
    ("a quote in const", {"const": 'a"b'}, "const", "/"),
    ("a backslash in an enum", {"enum": ["a\\b"]}, "enum", "/"),
    ("a newline in a property name", {"type": "object", "properties": {"a\nb": {}}}, "properties", "/properties"),
    ("an empty property name", {"type": "object", "properties": {"": {"type": "object"}}}, "properties",
     "/properties"),
    ("a boolean schema", {"type": "object", "properties": {"a": True}}, None, "/properties/a"),
    ("an unanchored pattern", {"type": "string", "pattern": "abc"}, "pattern", "/"),
    ("a look-ahead", {"type": "string", "pattern": "^(?=a)a$"}, "pattern", "/"),
    ("a word boundary", {"type": "string", "pattern": "^a\\b$"}, "pattern", "/"),
    ("a back-reference", {"type": "string", "pattern": "^(a)\\1$"}, "pattern", "/"),
    ("a newline in a pattern", {"type": "string", "pattern": "^a\\nb$"}, "pattern", "/"),
    ("a raw quote in a pattern", {"type": "string", "pattern": '^a"$'}, "pattern", "/"),
    ("a huge quantifier", {"type": "string", "pattern": "^a{5000}$"}, "pattern", "/"),
    ("a repeated group that can match nothing", {"type": "string", "pattern": "^(a?)*$"}, "pattern", "/"),
    ("nested bounded repetitions", {"type": "string", "pattern": "^(a{2,3}){200}$"}, "pattern", "/"),
    ("an unbalanced group", {"type": "string", "pattern": "^(a$"}, "pattern", "/"),
    ("a huge maxLength", {"type": "string", "maxLength": 100_000}, "maxLength", "/"),
    ("a huge maxItems", {"type": "array", "items": {}, "maxItems": 100_000}, "maxItems", "/"),
    ("minLength above maxLength", {"type": "string", "minLength": 3, "maxLength": 2}, "minLength", "/"),
    ("keywords of two types without a type", {"properties": {}, "items": {}}, None, "/"),
    ("a schema that is not an object", [1], None, "/"),
    ("a pattern on an integer that cannot be rewritten", {"type": "integer", "pattern": "^(?=x)$"}, "pattern", "/"),
]


@pytest.mark.parametrize(("what", "schema", "keyword", "path"), REFUSED, ids=[case[0] for case in REFUSED])
def test_what_a_grammar_cannot_enforce_is_refused_naming_the_keyword(what: str, schema: Any, keyword: str | None,
                                                                     path: str) -> None:
    with pytest.raises(ApplianceError) as caught:
        structured.schema_grammar(schema, "response_format.json_schema.schema")
    error = caught.value
    assert error.code == "BAD_REQUEST" and error.http_status == 400
    assert error.details["param"] == "response_format.json_schema.schema"
    assert error.details["path"] == path
    assert error.details.get("keyword") == keyword
    if keyword is not None:
        assert keyword in error.message


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


HOSTILE = [
    ("too deep", nested(200)),
    ("too big", {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 400}
                                                  for i in range(200)}}),
    ("too many nodes", {"anyOf": [{"type": "integer"}] * 2500}),
    ("too many properties", {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(300)}}),
    ("a huge enum", {"enum": list(range(5000))}),
    ("nested quantifiers", {"type": "string", "pattern": "^((a{256}){256}){256}$"}),
    ("a long pattern", {"type": "string", "pattern": "^" + "a" * 5000 + "$"}),
    ("NaN", {"const": float("nan")}),
]


@pytest.mark.parametrize(("what", "schema"), HOSTILE, ids=[case[0] for case in HOSTILE])
def test_a_hostile_schema_is_a_prompt_400(what: str, schema: Any) -> None:
    started = time.monotonic()
    with pytest.raises(ApplianceError) as caught:
        structured.schema_grammar(schema, "response_format.json_schema.schema")
    assert caught.value.code == "BAD_REQUEST"
    assert time.monotonic() - started < 5


def test_the_largest_allowed_repetitions_make_a_grammar_llama_cpp_takes(check: GrammarCheck) -> None:
    schema = {"type": "object", "properties": {
        "s": {"type": "string", "maxLength": structured.MAX_REPEAT},
        "l": {"type": "array", "items": {"type": "integer"}, "maxItems": structured.MAX_REPEAT},
        "p": {"type": "string", "pattern": f"^(ab{{0,16}}){{1,{structured.MAX_REPEAT // 16}}}$"}},
        "required": ["s", "l", "p"]}
    grammar = structured.schema_grammar(schema, "schema")
    assert len(grammar.gbnf) <= structured.MAX_GRAMMAR_CHARS
    assert check.accepts(grammar, json.dumps({"s": "x" * 256, "l": list(range(256)), "p": "abbbab"}))
    assert not check.accepts(grammar, json.dumps({"s": "x" * 257, "l": [], "p": "ab"}))


def test_a_string_never_holds_a_raw_control_character(check: GrammarCheck) -> None:
    grammar = structured.schema_grammar({"type": "object", "properties": {"s": {"type": "string"}}}, "schema")
    assert check.accepts(grammar, '{"s": "a\\nb\\u0001"}')
    assert not check.accepts(grammar, '{"s": "a\nb"}')  # the converter's own rule lets this through


def test_rules_are_renamed_apart_for_several_schemas_in_one_grammar(check: GrammarCheck) -> None:
    first = structured.schema_rules(TREE, "tools[0]", prefix="tool0")
    second = structured.schema_rules({"type": "object", "properties": {"node": {"type": "string"}}}, "tools[1]",
                                     prefix="tool1")
    assert first.root == "tool0-root" and all(name.startswith("tool0-") for name in first.rules)
    assert set(first.rules).isdisjoint(second.rules)
    both = structured.Grammar(f"root ::= {first.root} | {second.root}\n{first.gbnf()}\n{second.gbnf()}")
    assert check.accepts(both, json.dumps({"v": 1, "kids": [{"v": 2}]}))
    assert check.accepts(both, json.dumps({"node": "x"}))
    assert not check.accepts(both, json.dumps({"node": 1}))


# -- response_format -----------------------------------------------------------------------------------------------


def test_response_format_text_and_none_have_no_grammar() -> None:
    assert structured.response_grammar(None) is None
    assert structured.response_grammar({"type": "text"}) is None


def test_response_format_json_object_is_any_object(check: GrammarCheck) -> None:
    grammar = structured.response_grammar({"type": "json_object"})
    assert grammar is not None and not grammar.lazy
    assert check.accepts(grammar, '{"answer": [1, 2, {"x": null}], "ok": true}')
    assert not check.accepts(grammar, "[1, 2]")
    assert not check.accepts(grammar, "Sure! Here it is")


def test_response_format_json_schema(check: GrammarCheck) -> None:
    grammar = structured.response_grammar({"type": "json_schema", "json_schema": {
        "name": "answer", "strict": True, "schema": OBJECT_AB}})
    assert grammar is not None
    assert check.accepts(grammar, '{"a": "x", "b": 3}')
    assert not check.accepts(grammar, '{"b": 3}')
    schemaless = structured.response_grammar({"type": "json_schema", "json_schema": {"name": "any"}})
    assert schemaless is not None and check.accepts(schemaless, '{"free": "form"}')


@pytest.mark.parametrize(("value", "param"), [
    ("json", "response_format"),
    ({"type": "xml"}, "response_format.type"),
    ({"type": "text", "schema": {}}, "response_format.schema"),
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a b"}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "a", "strict": "yes"}}, "response_format.json_schema.strict"),
    ({"type": "json_schema", "json_schema": {"name": "a", "extra": 1}}, "response_format.json_schema.extra"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "integer", "minimum": 0}}},
     "response_format.json_schema.schema"),
])
def test_a_bad_response_format_is_refused_naming_the_field(value: Any, param: str) -> None:
    with pytest.raises(ApplianceError) as caught:
        structured.response_grammar(value)
    assert caught.value.code == "BAD_REQUEST" and caught.value.details["param"] == param
