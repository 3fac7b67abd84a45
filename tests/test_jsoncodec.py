"""The hot paths' JSON codec against the standard library: the same bytes (or the same meaning where the codec's
docstring says), the same values, the same errors, on payloads chosen to catch what JSON libraries disagree on."""

from __future__ import annotations

import base64
import json
import math
import random
import struct
from typing import Any

import pytest

from appliance.http import anthropic_schema, openai_schema, responses_schema
from appliance.protocol import jsoncodec
from appliance.protocol.frames import (
    HEADER,
    MAGIC,
    MAX_JSON_INT_DIGITS,
    VERSION,
    Frame,
    FrameParser,
    LocalProtocolError,
    RemoteProtocolError,
    encode_frame,
)


def stdlib_dumps(value: Any) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


SAME_BYTES = {
    "sse chunk": {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1700000000, "model": "demo",
                  "system_fingerprint": None, "choices": [{"index": 0, "delta": {"content": " the"},
                                                           "logprobs": None, "finish_reason": None}]},
    "non-ASCII as is": {"text": "é ü 東京 😀 \u2028\u2029 \x7f \u0080 \ufeff"},
    "control characters escaped": {"text": "".join(chr(code) for code in range(32)) + '"\\/'},
    "key order kept": {"z": 1, "a": 2, "m": {"y": 1, "b": 2}},
    "ints at the 64-bit edges": [0, -1, 2**63 - 1, -(2**63), 2**64 - 1],
    "ints past 64 bits": [2**64, -(2**63) - 1, 10**40],
    "floats without exponent": [0.0, -0.0, 0.1, 1.5, -2.25, 123456789.123, 1e15, 0.0001, 1 / 3, 2.0**52],
    "bool and null": [True, False, None],
    "tuples as arrays": {"a": (1, "x", (2,))},
    "empty containers": {"a": {}, "b": [], "c": ""},
    "nested": {"a": [{"b": [{"c": [1, 2, {"d": None}]}]}]},
    "int keys as strings": {1: "one", 2: "two"},
}


@pytest.mark.parametrize("value", SAME_BYTES.values(), ids=SAME_BYTES.keys())
def test_dumps_writes_the_stdlib_bytes(value: Any) -> None:
    assert jsoncodec.dumps(value) == stdlib_dumps(value)


@pytest.mark.parametrize("number", [1e16, 1e22, 1.5e300, 1e-7, 5e-324, 2.2250738585072014e-308, 1.7976931348623157e308,
                                    -1e-300, 6.02214076e23])
def test_dumps_writes_the_same_digits_and_exponent(number: float) -> None:
    written = jsoncodec.dumps({"x": number})
    assert json.loads(written) == {"x": number}
    mantissa, _, exponent = written[5:-1].partition(b"e")
    stdlib_mantissa, _, stdlib_exponent = stdlib_dumps({"x": number})[5:-1].partition(b"e")
    assert (mantissa, int(exponent)) == (stdlib_mantissa, int(stdlib_exponent))  # only the exponent's form differs


def test_dumps_round_trips_random_floats_to_the_same_value() -> None:
    rng = random.Random(7)
    values = [rng.uniform(-1, 1) * 10.0 ** rng.randint(-320, 300) for _ in range(2000)]
    values += [struct_float(rng.getrandbits(64)) for _ in range(2000)]
    finite = [value for value in values if math.isfinite(value)]
    assert json.loads(jsoncodec.dumps(finite)) == finite
    assert jsoncodec.loads(stdlib_dumps(finite)) == finite


def struct_float(bits: int) -> float:
    """The float whose IEEE 754 bits are ``bits`` (NaN, the infinities and subnormals included)."""
    return struct.unpack("<d", bits.to_bytes(8, "little"))[0]


def test_dumps_writes_nan_and_infinities_as_null() -> None:
    """The one difference in meaning: the stdlib wrote NaN and Infinity (not JSON); frames refuse them first."""
    assert jsoncodec.dumps([math.nan, math.inf, -math.inf]) == b"[null,null,null]"
    with pytest.raises(LocalProtocolError, match="not finite"):  # Frame() refuses NaN before encoding
        encode_frame({"x": math.nan})


def test_dumps_refuses_lone_surrogates_and_unknown_types_as_the_stdlib_path_did() -> None:
    with pytest.raises(UnicodeEncodeError):
        jsoncodec.dumps({"text": "\ud800"})
    with pytest.raises(UnicodeEncodeError):
        stdlib_dumps({"text": "\ud800"})
    with pytest.raises(TypeError):
        jsoncodec.dumps({"x": object()})


LOADS = {
    "duplicate keys: the last wins, first place kept": '{"a":1,"b":2,"a":3}',
    "big ints exact": "[18446744073709551615,18446744073709551616,-9223372036854775809,123456789012345678901234567890]",
    "floats": "[0.1,1e400,-1e400,1e-400,2.2250738585072011e-308,9007199254740993,1E2,-0.0,0.1e1]",
    "NaN and Infinity (stdlib accepts them)": "[NaN,Infinity,-Infinity]",
    "lone surrogate escape": '{"a":"\\ud800"}',
    "surrogate pair escape": '{"a":"\\ud83d\\ude00"}',
    "escapes": '"\\u0000\\n\\t\\"\\\\\\/\\u00e9"',
    "whitespace": ' \t\n\r{"a" : [ 1 , 2 ] }\r\n ',
    "non-ASCII": '{"東京":"é😀"}',
    "deep": "[" * 2000 + "]" * 2000,
    "scalar": "42",
}


def outcome(loads: Any, text: str) -> Any:
    try:
        value = loads(text)
    except (ValueError, RecursionError) as exc:
        return type(exc).__name__
    return json.dumps(value, ensure_ascii=True), repr(value)


@pytest.mark.parametrize("text", LOADS.values(), ids=LOADS.keys())
def test_loads_agrees_with_the_stdlib(text: str) -> None:
    assert outcome(jsoncodec.loads, text) == outcome(json.loads, text)
    assert outcome(jsoncodec.loads, text.encode()) == outcome(json.loads, text.encode())


INVALID = ['{"a":1}x', '\ufeff{}', '"\x01"', "01", "1.", ".5", "-", "[1,]", '{"a"}', "{'a':1}", "", "nul", '"abc',
           "[1 2]", '{"a":1,}', "Infinityx", "+1"]


@pytest.mark.parametrize("text", INVALID)
def test_loads_refuses_what_the_stdlib_refuses_with_its_error(text: str) -> None:
    with pytest.raises(json.JSONDecodeError) as expected:
        json.loads(text)
    with pytest.raises(json.JSONDecodeError) as got:
        jsoncodec.loads(text)
    assert str(got.value) == str(expected.value)


def refuse(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def test_loads_runs_the_callers_hooks_on_what_the_fast_decoder_refuses() -> None:
    with pytest.raises(ValueError, match="NaN is not JSON"):
        jsoncodec.loads('{"a":NaN}', parse_constant=refuse)
    assert jsoncodec.loads('{"a":1}', parse_constant=refuse) == {"a": 1}


def frame_bytes(text: bytes) -> bytes:
    body = base64.b64encode(text)
    return HEADER.pack(MAGIC, VERSION, len(body)) + body


FRAME_ERRORS = {
    "NaN": (b'{"a":{"b":NaN}}', {"stage": "json", "field": "a.b", "reason": "a.b: number is not finite"}),
    "1e400": (b'{"a":1e400}', {"stage": "json", "field": "a", "reason": "a: number is not finite"}),
    "21 digits": (b'{"a":' + b"1" * (MAX_JSON_INT_DIGITS + 1) + b"}",
                  {"stage": "json", "field": None, "reason": f"integer of more than {MAX_JSON_INT_DIGITS} digits",
                   "max_int_digits": MAX_JSON_INT_DIGITS}),
    "20 digits past the range": (b'{"a":[99999999999999999999]}',
                                 {"stage": "json", "field": "a[0]", "reason": "a[0]: integer out of the 64-bit range",
                                  "min": -(2**63), "max": 2**64 - 1}),
    "lone surrogate": (b'{"a":"\\udc00"}', {"stage": "json", "field": "a", "reason": "a: string is not valid Unicode"}),
}


@pytest.mark.parametrize("text, details", FRAME_ERRORS.values(), ids=FRAME_ERRORS.keys())
def test_frames_refuse_with_the_stdlib_errors(text: bytes, details: dict[str, Any]) -> None:
    parser = FrameParser()
    parser.receive_data(frame_bytes(text) + frame_bytes(b'{"ok":1}'))
    with pytest.raises(RemoteProtocolError) as info:
        parser.next_event()
    assert not info.value.fatal
    assert info.value.error.details == details
    frame = parser.next_event()
    assert isinstance(frame, Frame) and frame.payload == {"ok": 1}


def test_frames_encode_the_stdlib_bytes() -> None:
    payload = {"type": "STREAM_TOKEN", "task_id": "t-1", "token": " é東京", "index": 0, "n": 2**64 - 1, "f": 0.25}
    encoded = encode_frame(payload)
    assert base64.b64decode(encoded[10:]) == stdlib_dumps(payload)


def test_sse_events_write_the_stdlib_bytes() -> None:
    chunk = SAME_BYTES["sse chunk"]
    assert openai_schema.event(chunk) == f"data: {stdlib_dumps(chunk).decode()}\n\n".encode()
    assert openai_schema.event("[DONE]") == b"data: [DONE]\n\n"
    expected = 'event: ping\ndata: {"type":"ping","é":"東"}\n\n'.encode()
    assert anthropic_schema.event("ping", {"type": "ping", "é": "東"}) == expected
    payload = {"type": "response.output_text.delta", "delta": "é", "sequence_number": 3}
    assert responses_schema.event(payload) == (b"event: response.output_text.delta\ndata: " + stdlib_dumps(payload)
                                               + b"\n\n")
