"""``check_json`` judges plain JSON values without building their paths, and still names the path of the value that
fails: the same verdicts and errors for plain types, their subclasses and every kind of failure."""

from __future__ import annotations

import enum
from typing import Any

import pytest

from appliance.protocol.frames import MAX_JSON_DEPTH, LocalProtocolError, check_json


class Level(enum.IntEnum):
    LOW = 1


class Name(str):
    pass


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("value", [
    None, True, 0, -(2**63), 2**64 - 1, 1.5, "text", "é ✓", [], {}, {"a": [1, "b", {"c": None}]},
    Level.LOW, Name("n"), {Name("key"): [Level.LOW]}, nested(MAX_JSON_DEPTH - 1)])
def test_strict_json_values_pass(value: Any) -> None:
    check_json(value)


@pytest.mark.parametrize(("value", "field", "reason"), [
    ({"a": [1, {"b": float("nan")}]}, "a[1].b", "number is not finite"),
    ({"a": {"b": 2**64}}, "a.b", "integer out of the 64-bit range"),
    ([1, "\ud800"], "[1]", "string is not valid Unicode"),
    ({"a": {1: 2}}, "a", "object key 1 is not a string"),
    ({"a": (1, 2)}, "a", "tuple is not a JSON type"),
    ({"a": {Name("k"): float("inf")}}, "a.k", "number is not finite"),
    ({"a": nested(MAX_JSON_DEPTH)}, "a" + "[0]" * (MAX_JSON_DEPTH - 1), f"nested deeper than {MAX_JSON_DEPTH}"),
])
def test_a_failing_value_is_named_by_its_path(value: Any, field: str, reason: str) -> None:
    with pytest.raises(LocalProtocolError) as caught:
        check_json(value)
    assert caught.value.error.code == "BAD_PAYLOAD"
    assert caught.value.error.details["field"] == field
    assert caught.value.error.details["reason"] == reason
