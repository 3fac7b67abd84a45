"""Structured output (pure): a JSON Schema turned into a GBNF :class:`~appliance.engine.interface.Grammar` that only
JSON valid under the schema can follow, for OpenAI's ``response_format`` and for a tool's ``parameters``.

The conversion is llama-cpp-python's ``json_schema_to_gbnf`` (pure Python). It silently ignores many keywords and
mistranslates some values, so every schema is checked first, and whatever the grammar could not enforce is refused
with a P4 ``BAD_REQUEST`` whose details name the ``keyword`` and its ``path`` (a JSON pointer into the schema):

* accepted: ``type`` (one name, or a list of names with nothing else beside it), ``properties``, ``required`` (names
  of ``properties`` only), ``additionalProperties``, ``items`` (a schema or a list), ``prefixItems``, ``minItems``,
  ``maxItems`` (with ``items``), ``minLength``, ``maxLength`` (with ``type: string``), ``pattern``, ``format``
  (``date``, ``time``, ``date-time``, ``uuid``), ``enum``, ``const``, ``anyOf``, ``$ref`` (``#/...`` pointers into
  the same schema, recursion included), and annotations (``title``, ``description``, ``default``, ``examples``,
  ``$defs``, ``definitions``, ``$schema``, ``$id``, ``$comment``, ``deprecated``, ``readOnly``, ``writeOnly``,
  ``x-...``), which are dropped before the conversion;
* refused: every other keyword (``minimum``, ``maximum``, ``exclusiveMinimum``, ``exclusiveMaximum``,
  ``multipleOf``, ``minProperties``, ``maxProperties``, ``patternProperties``, ``propertyNames``,
  ``dependentRequired``, ``uniqueItems: true``, ``contains``, ``allOf``, ``oneOf`` (it would be enforced as
  ``anyOf``), ``not``, ``if``/``then``/``else``, ``nullable``, unknown formats, ...), a keyword the converter would
  ignore beside another (``$ref``, ``anyOf``, ``enum``, ``const`` or a type list with constraints beside them,
  ``pattern`` with ``format`` or lengths), boolean schemas (but ``additionalProperties``), and texts the grammar
  cannot spell as JSON (a property name, ``const`` or ``enum`` string holding ``"``, ``\\``, a control character
  or a character past U+FFFF);
* a ``pattern`` must be anchored (``^...$``) and is rewritten so that it only spells valid JSON string text:
  ``\\d``, ``\\w``, classes and ranges are kept, ``.`` and negated classes exclude ``"``, ``\\`` and control
  characters, and ``\\s`` matches a space only (a JSON string holds no raw tab or newline); look-arounds,
  back-references, ``\\b`` and the negated shorthands are refused.

Where JSON Schema allows more than the grammar does, the grammar is stricter and its output still valid: an empty
schema (``{}``) is any JSON *object*, undeclared properties are allowed only by ``additionalProperties``,
properties come in their declared order, and whitespace is at most one space. Every schema is bounded (its size,
depth, node count and repetition counts), and so is the grammar made of it: a hostile schema is a 400, never a
hang or a 500.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.engine.interface import Grammar
from appliance.errors import ApplianceError

MAX_SCHEMA_BYTES = 64 * 1024  # the schema as compact JSON
MAX_DEPTH = 24  # subschemas nested in subschemas
MAX_NODES = 2_000  # subschemas in all
MAX_REPEAT = 256  # minItems, maxItems, minLength, maxLength and a pattern's {m,n}
MAX_ENUM = 512  # values of one enum
MAX_PROPERTIES = 256  # properties of one object
MAX_PATTERN_CHARS = 1_000
MAX_GRAMMAR_CHARS = 512 * 1024

ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "$schema", "$id",
                         "deprecated", "readOnly", "writeOnly"})
DEFINITIONS = ("$defs", "definitions")
TYPES = frozenset({"string", "number", "integer", "boolean", "null", "object", "array"})
STRING_FORMATS = frozenset({"date", "time", "date-time", "uuid", "uuid1", "uuid2", "uuid3", "uuid4", "uuid5"})
OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties"})
ARRAY_KEYWORDS = frozenset({"items", "prefixItems", "minItems", "maxItems", "uniqueItems"})
STRING_KEYWORDS = frozenset({"pattern", "format", "minLength", "maxLength"})
ALONE = ("$ref", "anyOf", "const", "enum")
"""Keywords the converter reads without looking at anything beside them (but ``type``, checked, for const/enum)."""
SUPPORTED = frozenset({"type", *OBJECT_KEYWORDS, *ARRAY_KEYWORDS, *STRING_KEYWORDS, *ALONE, *DEFINITIONS})
HINTS = {"oneOf": "use anyOf (a grammar cannot exclude an output that matches two alternatives)",
         "allOf": "merge the schemas into one", "nullable": 'use "type": [..., "null"] or anyOf'}

CHAR_RULE = r'[^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F] [0-9a-fA-F])'
"""A JSON string's character: the converter's own rule lets raw control characters through (invalid JSON)."""
ANY_OBJECT: Mapping[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class SchemaRules:
    """A schema's grammar rules (``name ::= body``) and the name of its root rule."""

    root: str
    rules: dict[str, str]

    def gbnf(self) -> str:
        return "\n".join(f"{name} ::= {body}" for name, body in self.rules.items())


def refuse(param: str, path: str, keyword: str | None, message: str) -> ApplianceError:
    details: dict[str, Any] = {"param": param, "path": path or "/"}
    if keyword is not None:
        details["keyword"] = keyword
    return ApplianceError("BAD_REQUEST", f"{param}: {message}", details)


# -- the check -----------------------------------------------------------------------------------------------------


def pointer(path: str, key: str | int) -> str:
    return f"{path}/{str(key).replace('~', '~0').replace('/', '~1')}"


class _Check:
    """One walk over a schema: every subschema checked (:meth:`schema`), every ``$ref`` checked to point at one."""

    def __init__(self, root: Any, param: str) -> None:
        self.root = root
        self.param = param
        self.nodes = 0
        self.schemas: set[str] = set()  # the pointers of the subschemas walked
        self.refs: list[tuple[str, str]] = []  # (the pointer a $ref names, where it is)

    def fail(self, path: str, keyword: str | None, message: str) -> ApplianceError:
        if keyword is not None and keyword not in message:
            message = f"{keyword}: {message}"
        return refuse(self.param, path, keyword, message)

    def run(self) -> None:
        self.schema(self.root, "", 0)
        for target, where in self.refs:
            if target not in self.schemas:
                raise self.fail(where, "$ref", f"$ref {target!r} does not name a schema in this document")

    def schema(self, node: Any, path: str, depth: int) -> None:
        if isinstance(node, bool):
            raise self.fail(path, None, "a boolean schema is not supported (but as additionalProperties)")
        if not isinstance(node, dict):
            raise self.fail(path, None, "a schema must be an object")
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise self.fail(path, None, f"the schema has over {MAX_NODES} subschemas")
        if depth > MAX_DEPTH:
            raise self.fail(path, None, f"the schema nests over {MAX_DEPTH} levels deep")
        self.schemas.add(path)
        for key in node:
            if key not in SUPPORTED and key not in ANNOTATIONS and not key.startswith("x-"):
                hint = HINTS.get(key)
                raise self.fail(path, key, f"the keyword {key!r} is not supported" + (f": {hint}" if hint else ""))
        for container in DEFINITIONS:
            if container in node:
                definitions = node[container]
                if not isinstance(definitions, dict):
                    raise self.fail(path, container, f"{container} must be an object of schemas")
                for name, sub in definitions.items():
                    self.schema(sub, pointer(pointer(path, container), name), depth + 1)
        if "pattern" in node:  # rewritten for the converter whatever the type
            safe_pattern(node["pattern"], self.param, path)
        constraints = {key for key in node if key in SUPPORTED and key not in DEFINITIONS}
        alone = [key for key in ALONE if key in node]
        if alone:
            self.alone(node, path, depth, alone, constraints)
            return
        kind = node.get("type")
        if isinstance(kind, list):
            self.type_list(kind, path, constraints)
            return
        if kind is not None and kind not in TYPES:
            raise self.fail(path, "type", f"type must be one of {', '.join(sorted(TYPES))}")
        if uses(constraints, OBJECT_KEYWORDS) and kind in (None, "object"):
            self.object(node, path, depth)
        if uses(constraints, ARRAY_KEYWORDS) and kind in (None, "array"):
            self.array(node, path, depth)
        if uses(constraints, STRING_KEYWORDS) and kind in (None, "string"):
            self.string(node, path, kind)
        families = [uses(constraints, keywords) for keywords in (OBJECT_KEYWORDS, ARRAY_KEYWORDS, STRING_KEYWORDS)]
        if kind is None and sum(families) > 1:
            raise self.fail(path, None, "a schema without a type may use the keywords of one type only")

    def alone(self, node: dict[str, Any], path: str, depth: int, alone: list[str], constraints: set[str]) -> None:
        first = alone[0]
        beside = sorted(constraints - {first} - ({"type"} if first in ("const", "enum") else set()))
        if beside:
            raise self.fail(path, beside[0], f"{beside[0]!r} beside {first!r} would be ignored: nest them in anyOf "
                                             "alternatives or drop one")
        if first == "$ref":
            ref = node["$ref"]
            if not isinstance(ref, str) or not ref.startswith("#") or "~" in ref or ref == "#":
                raise self.fail(path, "$ref", "$ref must be a pointer into this schema (#/...) without ~ escapes")
            self.refs.append((ref[1:], path))
        elif first == "anyOf":
            options = node["anyOf"]
            if not isinstance(options, list) or not options:
                raise self.fail(path, "anyOf", "anyOf must be a non-empty list of schemas")
            for index, option in enumerate(options):
                self.schema(option, pointer(pointer(path, "anyOf"), index), depth + 1)
        else:
            values = [node["const"]] if first == "const" else node["enum"]
            if first == "enum" and (not isinstance(values, list) or not 0 < len(values) <= MAX_ENUM):
                raise self.fail(path, "enum", f"enum must be a list of 1 to {MAX_ENUM} values")
            kind = node.get("type")
            for value in values:
                self.literal(value, path, first)
                if kind is not None and not fits(value, kind):
                    raise self.fail(path, first, f"the value {value!r} is not of type {kind!r}")

    def type_list(self, kinds: list[Any], path: str, constraints: set[str]) -> None:
        if not kinds or any(k not in TYPES for k in kinds) or len(set(kinds)) != len(kinds):
            raise self.fail(path, "type", f"a type list must name distinct types of {', '.join(sorted(TYPES))}")
        beside = sorted(constraints - {"type"})
        if beside:
            raise self.fail(path, beside[0], f"{beside[0]!r} beside a list of types would be ignored: use anyOf "
                                             "with one schema per type")

    def object(self, node: dict[str, Any], path: str, depth: int) -> None:
        properties = node.get("properties", {})
        if not isinstance(properties, dict) or len(properties) > MAX_PROPERTIES:
            raise self.fail(path, "properties", f"properties must be an object of at most {MAX_PROPERTIES} schemas")
        for name, sub in properties.items():
            if not name:
                raise self.fail(pointer(path, "properties"), "properties", "a property name must not be empty")
            self.text(name, pointer(path, "properties"), "properties", "a property name")
            self.schema(sub, pointer(pointer(path, "properties"), name), depth + 1)
        required = node.get("required", [])
        if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
            raise self.fail(path, "required", "required must be a list of property names")
        for name in required:
            if name not in properties:
                raise self.fail(path, "required", f"required names {name!r}, which is not in properties")
        extra = node.get("additionalProperties")
        if extra is not None and not isinstance(extra, bool):
            self.schema(extra, pointer(path, "additionalProperties"), depth + 1)

    def array(self, node: dict[str, Any], path: str, depth: int) -> None:
        items = node.get("items")
        prefix = node.get("prefixItems")
        if node.get("uniqueItems", False) is not False:
            raise self.fail(path, "uniqueItems", "uniqueItems: true is not supported")
        if prefix is not None and items not in (None, False):
            raise self.fail(path, "prefixItems", "prefixItems with items would be read as items alone")
        tuple_form = isinstance(items, list) or prefix is not None
        counts = [key for key in ("minItems", "maxItems") if key in node]
        if counts and (tuple_form or items is None):
            raise self.fail(path, counts[0], f"{counts[0]} needs items (one schema for every item)")
        for key in counts:
            self.count(node[key], path, key)
        if len(counts) == 2 and node["minItems"] > node["maxItems"]:
            raise self.fail(path, "minItems", "minItems is above maxItems")
        if tuple_form:
            listed = prefix if prefix is not None else items
            key = "prefixItems" if prefix is not None else "items"
            if not isinstance(listed, list) or not listed:
                raise self.fail(path, key, f"{key} must be a non-empty list of schemas")
            for index, sub in enumerate(listed):
                self.schema(sub, pointer(pointer(path, key), index), depth + 1)
        elif items is not None:
            self.schema(items, pointer(path, "items"), depth + 1)

    def string(self, node: dict[str, Any], path: str, kind: str | None) -> None:
        lengths = [key for key in ("minLength", "maxLength") if key in node]
        for key in ("pattern", "format"):
            if key in node:
                beside = [other for other in ("pattern", "format", *lengths) if other != key and other in node]
                if beside:
                    raise self.fail(path, beside[0], f"{beside[0]!r} beside {key!r} would be ignored")
        if "format" in node and node["format"] not in STRING_FORMATS:
            raise self.fail(path, "format", f"the format {node['format']!r} is not supported (only "
                                            f"{', '.join(sorted(STRING_FORMATS))})")
        if lengths and kind != "string":
            raise self.fail(path, lengths[0], f"{lengths[0]} needs \"type\": \"string\" beside it")
        for key in lengths:
            self.count(node[key], path, key)
        if len(lengths) == 2 and node["minLength"] > node["maxLength"]:
            raise self.fail(path, "minLength", "minLength is above maxLength")

    def count(self, value: Any, path: str, key: str) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_REPEAT:
            raise self.fail(path, key, f"{key} must be an integer from 0 to {MAX_REPEAT}")

    def literal(self, value: Any, path: str, keyword: str) -> None:
        """A const / enum value: the converter writes it as JSON text into the grammar, which spells only some."""
        if isinstance(value, str):
            self.text(value, path, keyword, f"a {keyword} string")
        elif isinstance(value, list):
            for item in value:
                self.literal(item, path, keyword)
        elif isinstance(value, dict):
            for key, item in value.items():
                self.text(key, path, keyword, f"a {keyword} key")
                self.literal(item, path, keyword)

    def text(self, value: str, path: str, keyword: str, what: str) -> None:
        bad = next((c for c in value if c in '"\\' or ord(c) < 0x20 or ord(c) > 0xFFFF), None)
        if bad is not None:
            raise self.fail(path, keyword, f"{what} holds {bad!r}, which the grammar cannot spell as JSON")


def uses(constraints: set[str], keywords: frozenset[str]) -> bool:
    return not constraints.isdisjoint(keywords)


def fits(value: Any, kind: str) -> bool:
    """``value`` is of the JSON Schema type ``kind``."""
    if kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool) or isinstance(value, float) and value.is_integer()
    if kind == "number":
        return isinstance(value, int | float) and not isinstance(value, bool)
    kinds: dict[str, type | tuple[type, ...]] = {"string": str, "boolean": bool, "object": dict, "array": list,
                                                 "null": type(None)}
    return isinstance(value, kinds[kind])


# -- patterns ------------------------------------------------------------------------------------------------------

FORBIDDEN = ((0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C))
"""What a JSON string's text never holds raw: control characters, ``"`` and ``\\`` (they are written escaped)."""
SHORTHAND = {"d": ((0x30, 0x39),), "w": ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)),
             "s": ((0x20, 0x20),)}
QUANTIFIER = re.compile(r"\{(\d*)(,(\d*))?\}")
REFUSED_ESCAPES = {"b": "\\b (a word boundary)", "B": "\\B", "D": "\\D", "W": "\\W", "S": "\\S",
                   "n": "a newline", "r": "a carriage return", "t": "a tab", "f": "a form feed", "v": "a vertical tab",
                   "0": "a NUL", "p": "\\p", "P": "\\P", "k": "\\k", "c": "\\c"}


class _PatternError(Exception):
    pass


def safe_pattern(pattern: Any, param: str, path: str) -> str:
    """``pattern`` rewritten for the converter so that it spells only valid JSON string text (see the module
    docstring); raises ``BAD_REQUEST`` for what it cannot."""
    if not isinstance(pattern, str) or not 2 <= len(pattern) <= MAX_PATTERN_CHARS:
        raise refuse(param, path, "pattern", f"a pattern must be a string of 2 to {MAX_PATTERN_CHARS} characters")
    if not pattern.startswith("^") or not pattern.endswith("$") or pattern.endswith("\\$"):
        raise refuse(param, path, "pattern", "a pattern must be anchored: ^...$")
    try:
        return "^(" + _rewrite(pattern[1:-1]) + ")$"
    except _PatternError as exc:
        raise refuse(param, path, "pattern", f"the pattern {pattern!r} is not supported: {exc}") from None


@dataclass
class _Group:
    """A group of a pattern while it is read: its current alternative's items, each (it can match nothing, the
    product of the bounded repetitions nested in it), and what its earlier alternatives gave."""

    items: list[tuple[bool, int]] = field(default_factory=list)
    nullable: bool = False
    weight: int = 1

    def settle(self) -> None:
        self.nullable = self.nullable or all(nullable for nullable, _ in self.items)
        self.weight = max([self.weight, *(weight for _, weight in self.items)])
        self.items = []


class _Shape:
    """How a pattern's repetitions nest. llama.cpp keeps one parse stack per way a text can be read so far: a
    repeated group that can match nothing is refused (left recursion, or no end of ways), and so are bounded
    repetitions nested to a product over :data:`MAX_REPEAT` (as many stacks)."""

    def __init__(self) -> None:
        self.stack = [_Group()]

    def atom(self) -> None:
        self.stack[-1].items.append((False, 1))

    def open(self) -> None:
        self.stack.append(_Group())

    def close(self) -> None:
        if len(self.stack) == 1:
            raise _PatternError("an unbalanced ')'")
        group = self.stack.pop()
        group.settle()
        self.stack[-1].items.append((group.nullable, group.weight))

    def alternative(self) -> None:
        self.stack[-1].settle()

    def repeat(self, low: int, high: int | None) -> None:
        items = self.stack[-1].items
        if not items:
            raise _PatternError("a quantifier with nothing to repeat")
        nullable, weight = items[-1]
        if nullable and (high is None or high > 1):
            raise _PatternError("a repeated group that can match nothing")
        if high is not None and high > 1:
            weight *= high
        if weight > MAX_REPEAT:
            raise _PatternError(f"repetitions nested to over {MAX_REPEAT} in all")
        items[-1] = (nullable or low == 0, weight)

    def end(self) -> None:
        if len(self.stack) != 1:
            raise _PatternError("an unclosed '('")


QUANTIFIERS = {"*": (0, None), "+": (1, None), "?": (0, 1)}


def _rewrite(inner: str) -> str:
    out: list[str] = []
    shape = _Shape()
    i = 0
    while i < len(inner):
        c = inner[i]
        if c == "\\":
            ranges, i = _escape(inner, i)
            out.append(_class(ranges, negated=False))
            shape.atom()
            continue
        if c == "[":
            text, i = _char_class(inner, i)
            out.append(text)
            shape.atom()
            continue
        if c == "(":
            if inner.startswith("(?:", i):
                out.append("(")
                shape.open()
                i += 3
                continue
            if inner.startswith("(?", i):
                raise _PatternError("look-arounds and named groups are not supported")
            out.append(c)
            shape.open()
        elif c == "{":
            match = QUANTIFIER.match(inner, i)
            if match is None or not (match.group(1) or match.group(3)):
                raise _PatternError("a '{' that is not a quantifier must be escaped")
            for number in (match.group(1), match.group(3)):
                if number and int(number) > MAX_REPEAT:
                    raise _PatternError(f"a quantifier above {MAX_REPEAT}")
            low = int(match.group(1) or 0)
            high = low if match.group(2) is None else int(match.group(3)) if match.group(3) else None
            if high is not None and low > high:
                raise _PatternError("a quantifier {m,n} with m above n")
            shape.repeat(low, high)
            out.append(match.group(0))
            i = match.end()
            continue
        elif c in QUANTIFIERS:
            shape.repeat(*QUANTIFIERS[c])
            out.append(c)
        elif c == ")":
            shape.close()
            out.append(c)
        elif c == "|":
            shape.alternative()
            out.append(c)
        elif c in "^$":
            raise _PatternError(f"{c!r} is allowed only at the ends")
        elif _forbidden(ord(c)) or ord(c) > 0xFFFF:
            raise _PatternError(f"{c!r} cannot be written in a JSON string as it is")
        elif c == ".":
            out.append(_class((), negated=True))
            shape.atom()
        elif c in "}]":
            out.append(_class(((ord(c), ord(c)),), negated=False))
            shape.atom()
        else:
            out.append(c)
            shape.atom()
        i += 1
    shape.end()
    return "".join(out)


def _escape(text: str, i: int) -> tuple[tuple[tuple[int, int], ...], int]:
    """The code point ranges of the escape at ``text[i]`` (a backslash) and the index after it."""
    if i + 1 >= len(text):
        raise _PatternError("a trailing backslash")
    c = text[i + 1]
    if c in SHORTHAND:
        return SHORTHAND[c], i + 2
    if c in REFUSED_ESCAPES or c.isdigit():
        raise _PatternError(f"{REFUSED_ESCAPES.get(c, 'a back-reference')} is not supported")
    if c in "ux":
        digits = 4 if c == "u" else 2
        code = text[i + 2:i + 2 + digits]
        if len(code) != digits or not all(d in "0123456789abcdefABCDEF" for d in code):
            raise _PatternError(f"\\{c} needs {digits} hex digits")
        point = int(code, 16)
        return _allowed(point), i + 2 + digits
    if c.isalnum():
        raise _PatternError(f"the escape \\{c} is not supported")
    return _allowed(ord(c)), i + 2


def _allowed(point: int) -> tuple[tuple[int, int], ...]:
    if _forbidden(point):
        raise _PatternError(f"{chr(point)!r} cannot be written in a JSON string as it is")
    return ((point, point),)


def _forbidden(point: int) -> bool:
    return any(lo <= point <= hi for lo, hi in FORBIDDEN)


def _char_class(text: str, i: int) -> tuple[str, int]:
    """The class at ``text[i]`` (``[``) as a grammar class of escapes, and the index after it."""
    i += 1
    negated = text.startswith("^", i)
    if negated:
        i += 1
    ranges: list[tuple[int, int]] = []
    first = True
    while True:
        if i >= len(text):
            raise _PatternError("an unclosed '['")
        c = text[i]
        if c == "]" and not first:
            i += 1
            break
        first = False
        if c == "\\":
            found, i = _escape(text, i)
            if len(found) > 1 or found[0][0] != found[0][1]:  # \d, \w: no range from them
                ranges.extend(found)
                continue
            low = found[0][0]
        else:
            low = ord(c)
            i += 1
        high = low
        if text.startswith("-", i) and i + 1 < len(text) and text[i + 1] != "]":
            if text[i + 1] == "\\":
                found, i = _escape(text, i + 1)
                if len(found) > 1 or found[0][0] != found[0][1]:
                    raise _PatternError("a range cannot end with a shorthand class")
                high = found[0][0]
            else:
                high = ord(text[i + 1])
                i += 2
            if high < low:
                raise _PatternError("a range out of order")
        ranges.append((low, high))
    if not negated:
        ranges = _without_forbidden(ranges)
        if not ranges:
            raise _PatternError("a class that holds only characters a JSON string cannot hold as they are")
    return _class(tuple(ranges), negated=negated), i


def _without_forbidden(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    kept: list[tuple[int, int]] = []
    for low, high in ranges:
        pieces = [(low, high)]
        for f_low, f_high in FORBIDDEN:
            cut: list[tuple[int, int]] = []
            for p_low, p_high in pieces:
                if p_high < f_low or p_low > f_high:
                    cut.append((p_low, p_high))
                    continue
                if p_low < f_low:
                    cut.append((p_low, f_low - 1))
                if p_high > f_high:
                    cut.append((f_high + 1, p_high))
            pieces = cut
        kept.extend(pieces)
    return kept


def _class(ranges: tuple[tuple[int, int], ...] | list[tuple[int, int]], *, negated: bool) -> str:
    """A grammar character class of escaped code points (a negated one also excludes :data:`FORBIDDEN`); the
    converter copies a class as it is, and an escape inside one is safe from its literal handling."""
    items = list(ranges) + (list(FORBIDDEN) if negated else [])
    body = "".join(_point(lo) if lo == hi else f"{_point(lo)}-{_point(hi)}" for lo, hi in items)
    return f"[{'^' if negated else ''}{body}]"


def _point(point: int) -> str:
    return f"\\x{point:02X}" if point < 0x100 else f"\\u{point:04X}"


# -- the conversion ------------------------------------------------------------------------------------------------


@functools.cache
def converter() -> Callable[[str], str]:
    """llama-cpp-python's ``json_schema_to_gbnf``, loaded from its own file: ``import llama_cpp.llama_grammar``
    would run the package's ``__init__``, which loads the native library, and this module stays pure."""
    package = importlib.util.find_spec("llama_cpp")  # finds the package without importing it
    if package is None or not package.submodule_search_locations:
        raise RuntimeError("llama-cpp-python is not installed")
    path = Path(next(iter(package.submodule_search_locations))) / "llama_grammar.py"
    spec = importlib.util.spec_from_file_location("appliance.engine._llama_grammar", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    convert: Callable[[str], str] = module.json_schema_to_gbnf
    return convert


RULE_NAME_CHARS = re.compile(r"[^a-zA-Z0-9-]+")


class _ForConverter:
    """A checked schema made ready for the converter: annotations dropped (it fails on a schema of annotations
    only), patterns rewritten (:func:`safe_pattern`), and every ``$ref`` target moved to the root's ``$defs`` under
    a name of its own. The converter names a target's rule by the ``$ref``'s last segment and takes a rule of that
    name that already exists (a property's, ``space``) for it, and it does not look beside a ``$ref``: the names
    chosen start with a prefix no property or definition name starts with."""

    def __init__(self, root: Any) -> None:
        self.root = root
        names = set(_names(root))
        number = 0
        while any(name.startswith(f"ref{number}d") for name in names):
            number += 1
        self.prefix = f"ref{number}d"
        self.targets: dict[str, str] = {}
        self.defs: dict[str, Any] = {}

    def schema(self) -> Any:
        out = self.node(self.root)
        if not self.defs:
            return out
        if "$ref" in out:
            out = {"anyOf": [out]}
        return {**out, "$defs": self.defs}

    def node(self, node: Any) -> Any:
        if isinstance(node, list):
            return [self.node(item) for item in node]
        if not isinstance(node, dict):
            return node
        out: dict[str, Any] = {}
        for key, value in node.items():
            if key in ANNOTATIONS or key in DEFINITIONS or key.startswith("x-"):
                continue
            if key == "properties":
                out[key] = {name: self.node(sub) for name, sub in value.items()}
            elif key in ("const", "enum"):
                out[key] = value
            elif key == "pattern":
                out[key] = "^(" + _rewrite(value[1:-1]) + ")$"
            elif key == "$ref":
                out[key] = "#/$defs/" + self.target(value[1:])
            else:
                out[key] = self.node(value)
        return out

    def target(self, path: str) -> str:
        name = self.targets.get(path)
        if name is None:
            name = self.targets[path] = f"{self.prefix}{len(self.targets)}"
            self.defs[name] = self.node(resolve(self.root, path))
        return name


def _names(node: Any) -> Iterator[str]:
    """Every property and definition name in a schema, as the converter makes rule names of them."""
    if isinstance(node, list):
        for item in node:
            yield from _names(item)
    elif isinstance(node, dict):
        for key, value in node.items():
            if key in ("properties", *DEFINITIONS) and isinstance(value, dict):
                for name in value:
                    yield RULE_NAME_CHARS.sub("-", name)
            if key not in ("const", "enum"):
                yield from _names(value)


def resolve(root: Any, path: str) -> Any:
    """The node at the JSON pointer ``path`` (checked to name a subschema)."""
    node = root
    for part in path.split("/")[1:]:
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


GBNF_TOKEN = re.compile(r'"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|[A-Za-z0-9-]+|\s+|.', re.DOTALL)


def parse_rules(gbnf: str) -> dict[str, str]:
    """The converter's output (one ``name ::= body`` per line) as {name: body}."""
    rules: dict[str, str] = {}
    for line in gbnf.splitlines():
        name, sep, body = line.partition(" ::= ")
        if not sep:
            raise ValueError(f"not a rule line: {line[:80]!r}")
        rules[name] = body
    return rules


def renamed(rules: dict[str, str], prefix: str) -> dict[str, str]:
    """``rules`` with every rule name (definitions and references) prefixed by ``prefix-``."""
    def rename(body: str) -> str:
        tokens = GBNF_TOKEN.findall(body)
        return "".join(f"{prefix}-{t}" if t in rules else t for t in tokens)

    return {f"{prefix}-{name}": rename(body) for name, body in rules.items()}


RELAXABLE = frozenset({"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minProperties",
                       "maxProperties", "propertyNames", "dependentRequired", "dependentSchemas", "uniqueItems",
                       "contains", "minContains", "maxContains", "unevaluatedProperties", "unevaluatedItems",
                       "contentEncoding", "contentMediaType", "nullable"})
"""Keywords that only narrow the values a schema allows (or, ``nullable``, widen them in a way a stricter grammar
may ignore): a tool's schema may keep them (:func:`relax`), its grammar then allows a little more or less."""
SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
REPEATS = ("minLength", "maxLength", "minItems", "maxItems")
MAX_RELAXED_REPEAT = 32
"""A tool schema's counts kept in its grammar: the converter writes a bound ``n`` as groups nested ``n`` deep, and a
grammar nests at most :data:`appliance.engine.sampling.MAX_GRAMMAR_NESTING` (64) deep."""


def relax(schema: Any) -> tuple[Any, tuple[str, ...]]:
    """A tool's ``parameters`` as its grammar follows them, and what was left out (``keyword at /path``).

    Agents send tool schemas written for validators (Claude Code's ask for ``minimum``, ``propertyNames``,
    ``format: uri``…), and a request must not be refused because its tools say more than a grammar can enforce:
    :data:`RELAXABLE` keywords, unknown formats and counts over :data:`MAX_RELAXED_REPEAT` are dropped, ``oneOf``
    is read as ``anyOf``, and lengths beside a ``pattern`` go. The grammar still forces well-formed JSON with the
    schema's properties and types, and the template shows the model the schema as sent. ``response_format`` is never
    relaxed: its output must match."""
    dropped: list[str] = []

    def node(value: Any, path: str) -> Any:
        if not isinstance(value, dict):
            return value
        out: dict[str, Any] = {}
        for key, sub in value.items():
            where = pointer(path, key)
            too_many = key in REPEATS and isinstance(sub, int) and sub > MAX_RELAXED_REPEAT
            if key in RELAXABLE or too_many or (key == "format" and sub not in STRING_FORMATS):
                dropped.append(f"{key} at {path or '/'}")
            elif key == "oneOf" and "anyOf" not in value and isinstance(sub, list):
                out["anyOf"] = [node(item, pointer(where, i)) for i, item in enumerate(sub)]
            elif key in ("properties", *DEFINITIONS) and isinstance(sub, dict):
                out[key] = {name: node(item, pointer(where, name)) for name, item in sub.items()}
            elif key in SUBSCHEMA_LISTS and isinstance(sub, list):
                out[key] = [node(item, pointer(where, i)) for i, item in enumerate(sub)]
            elif key in ("items", "additionalProperties"):
                out[key] = [node(item, pointer(where, i)) for i, item in enumerate(sub)] if isinstance(sub, list) \
                    else node(sub, where)
            else:
                out[key] = sub
        if "pattern" in out:
            for key in ("minLength", "maxLength"):
                if out.pop(key, None) is not None:
                    dropped.append(f"{key} at {path or '/'}")
        return out

    return node(schema, ""), tuple(dropped)


def schema_rules(schema: Any, param: str, prefix: str | None = None, *, relaxed: bool = False) -> SchemaRules:
    """The grammar rules of ``schema`` (checked: ``BAD_REQUEST`` for what they could not enforce; ``relaxed``: a
    tool's schema, :func:`relax` ed first), their names prefixed by ``prefix-`` when given (several schemas in one
    grammar)."""
    if relaxed:
        schema, _ = relax(schema)
    try:
        size = len(json.dumps(schema, separators=(",", ":"), allow_nan=False))
    except (TypeError, ValueError, RecursionError):
        raise refuse(param, "", None, "the schema is not JSON") from None
    if size > MAX_SCHEMA_BYTES:
        raise refuse(param, "", None, f"the schema is over {MAX_SCHEMA_BYTES} bytes as JSON")
    _Check(schema, param).run()
    try:
        rules = parse_rules(converter()(json.dumps(_ForConverter(schema).schema())))
    except (AssertionError, ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
        raise refuse(param, "", None, f"the schema cannot be turned into a grammar: {exc}") from None
    if "char" in rules:
        rules["char"] = CHAR_RULE
    root = "root"
    if prefix is not None:
        rules = renamed(rules, prefix)
        root = f"{prefix}-root"
    if sum(len(name) + len(body) + 5 for name, body in rules.items()) > MAX_GRAMMAR_CHARS:
        raise refuse(param, "", None, f"the schema's grammar is over {MAX_GRAMMAR_CHARS} characters")
    return SchemaRules(root, rules)


def schema_grammar(schema: Any, param: str) -> Grammar:
    """The grammar of JSON valid under ``schema`` (see the module docstring)."""
    return Grammar(schema_rules(schema, param).gbnf())


# -- response_format -----------------------------------------------------------------------------------------------

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def response_grammar(value: Any, param: str = "response_format") -> Grammar | None:
    """OpenAI's ``response_format``: ``{"type": "text"}`` (or none) is no grammar, ``{"type": "json_object"}`` any
    JSON object, ``{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`` JSON valid
    under the schema (without one: any object). ``strict: false`` changes nothing: the schema is always enforced,
    and what cannot be is refused."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ApplianceError("BAD_REQUEST", f"{param} must be an object", {"param": param})
    kind = value.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if kind not in allowed:
        raise ApplianceError("BAD_REQUEST", f"{param}.type must be text, json_object or json_schema",
                             {"param": f"{param}.type"})
    unknown = sorted(set(value) - allowed[kind])
    if unknown:
        raise ApplianceError("BAD_REQUEST", f"unknown field {param}.{unknown[0]}", {"param": f"{param}.{unknown[0]}"})
    if kind == "text":
        return None
    if kind == "json_object":
        return schema_grammar(ANY_OBJECT, param)
    spec = value.get("json_schema")
    where = f"{param}.json_schema"
    if not isinstance(spec, dict):
        raise ApplianceError("BAD_REQUEST", f"{where} must be an object", {"param": where})
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise ApplianceError("BAD_REQUEST", f"unknown field {where}.{unknown[0]}", {"param": f"{where}.{unknown[0]}"})
    name = spec.get("name")
    if not isinstance(name, str) or not NAME.fullmatch(name):
        raise ApplianceError("BAD_REQUEST", f"{where}.name must be 1 to 64 letters, digits, _ or -",
                             {"param": f"{where}.name"})
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise ApplianceError("BAD_REQUEST", f"{where}.strict must be a boolean", {"param": f"{where}.strict"})
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise ApplianceError("BAD_REQUEST", f"{where}.description must be a string",
                             {"param": f"{where}.description"})
    schema = spec.get("schema", ANY_OBJECT)
    return schema_grammar(schema, f"{where}.schema")
