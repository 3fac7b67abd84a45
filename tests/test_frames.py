"""The MAGN frame codec (SPEC P1, P2, R1): golden vectors, every refusal, and fuzzing."""

from __future__ import annotations

import base64
import json
import struct
from unittest import mock

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.protocol import frames
from appliance.protocol.frames import (
    CLOSED,
    HEADER,
    MAGIC,
    MAGIC_BYTES,
    MAX_JSON_DEPTH,
    MAX_JSON_INT_DIGITS,
    MAX_JSON_ITEMS,
    NEED_DATA,
    VERSION,
    Frame,
    FrameParser,
    LocalProtocolError,
    ParserState,
    RemoteProtocolError,
    count_json_items,
    encode_frame,
    is_valid_unicode,
    looks_like_magn,
)

# ONE table drives both the encoder and the decoder tests: (payload, the exact bytes on the wire).
GOLDEN: list[tuple[dict, bytes]] = [
    ({"prompt": "test"}, bytes.fromhex("4d474e54 0001 00000018") + b"eyJwcm9tcHQiOiJ0ZXN0In0="),
    ({}, bytes.fromhex("4d474e54 0001 00000004") + b"e30="),
    ({"type": "PROTOCOL_INFO"}, bytes.fromhex("4d474e54 0001 00000020") + b"eyJ0eXBlIjoiUFJPVE9DT0xfSU5GTyJ9"),
    ({"text": "h\u00e9llo \u2713"}, bytes.fromhex("4d474e54 0001 0000001c") + b"eyJ0ZXh0IjoiaMOpbGxvIOKckyJ9"),
    ({"a": [1, 2.5, True, None], "b": {"c": "d"}},
     bytes.fromhex("4d474e54 0001 00000034") + b"eyJhIjpbMSwyLjUsdHJ1ZSxudWxsXSwiYiI6eyJjIjoiZCJ9fQ=="),
]
IDS = [json.dumps(p) for p, _ in GOLDEN]


def frame_of(body: bytes, *, version: int = VERSION, length: int | None = None) -> bytes:
    """A frame with an arbitrary (possibly invalid) payload, built without the codec."""
    return struct.pack(">IHI", MAGIC, version, len(body) if length is None else length) + body


def raw_frame(data: bytes) -> bytes:
    return frame_of(base64.b64encode(data))


def parse_all(data: bytes, *, chunks: list[int] | None = None, eof: bool = False,
              max_frame_bytes: int = 1 << 24) -> tuple[list[Frame], FrameParser]:
    """Feed ``data`` in ``chunks`` (sizes, cycled; default: all at once) and collect every frame."""
    parser, frames, pos, sizes = FrameParser(max_frame_bytes), [], 0, chunks or [len(data) or 1]
    i = 0
    while pos < len(data):
        size = sizes[i % len(sizes)]
        parser.receive_data(data[pos:pos + size])
        pos, i = pos + size, i + 1
        while isinstance(event := parser.next_event(), Frame):
            frames.append(event)
    if eof:
        parser.receive_data(b"")
        while isinstance(event := parser.next_event(), Frame):
            frames.append(event)
    return frames, parser


def refused(data: bytes, **kwargs: object) -> RemoteProtocolError:
    with pytest.raises(RemoteProtocolError) as info:
        parse_all(data, **kwargs)  # type: ignore[arg-type]
    return info.value


# --- golden vectors --------------------------------------------------------------------------------------------


def test_prompt_frame_starts_with_magic_and_version_and_length_is_base64_length() -> None:
    wire = encode_frame({"prompt": "test"})
    assert wire[:6] == bytes([0x4D, 0x47, 0x4E, 0x54, 0x00, 0x01])
    assert wire[:4] == MAGIC_BYTES
    (length,) = struct.unpack(">I", wire[6:10])
    assert length == len(wire) - HEADER.size == len(base64.b64encode(b'{"prompt":"test"}'))


@pytest.mark.parametrize(("payload", "wire"), GOLDEN, ids=IDS)
def test_golden_encode(payload: dict, wire: bytes) -> None:
    assert encode_frame(payload) == wire
    assert Frame(payload).to_bytes() == wire


@pytest.mark.parametrize(("payload", "wire"), GOLDEN, ids=IDS)
@pytest.mark.parametrize("chunks", [None, [1], [3, 7]], ids=["whole", "byte-by-byte", "3-7"])
def test_golden_decode(payload: dict, wire: bytes, chunks: list[int] | None) -> None:
    frames, parser = parse_all(wire, chunks=chunks)
    assert frames == [Frame(payload)]
    assert parser.state is ParserState.HEADER and parser.trailing_data == b""


@pytest.mark.parametrize(("payload", "wire"), GOLDEN, ids=IDS)
def test_golden_decode_keeps_trailing_bytes_for_the_next_frame(payload: dict, wire: bytes) -> None:
    parser = FrameParser()
    parser.receive_data(wire + wire[:5])
    assert parser.next_event() == Frame(payload)
    assert parser.next_event() is NEED_DATA
    assert parser.trailing_data == wire[:5]
    parser.receive_data(wire[5:])
    assert parser.next_event() == Frame(payload)
    assert parser.next_event() is NEED_DATA and parser.trailing_data == b""


def test_all_golden_frames_in_one_stream_then_clean_eof() -> None:
    stream = b"".join(wire for _, wire in GOLDEN)
    frames, parser = parse_all(stream, chunks=[5, 1, 13], eof=True)
    assert [f.payload for f in frames] == [p for p, _ in GOLDEN]
    assert parser.next_event() is CLOSED and parser.state is ParserState.CLOSED


def test_states_while_reading_a_frame() -> None:
    parser = FrameParser()
    wire = GOLDEN[0][1]
    assert parser.state is ParserState.HEADER
    parser.receive_data(wire[:HEADER.size + 2])
    assert parser.next_event() is NEED_DATA and parser.state is ParserState.PAYLOAD
    parser.receive_data(wire[HEADER.size + 2:])
    assert isinstance(parser.next_event(), Frame) and parser.state is ParserState.HEADER


def test_looks_like_magn_sniffs_the_first_bytes() -> None:
    for prefix in (b"", b"M", b"MG", b"MGN", MAGIC_BYTES, GOLDEN[0][1]):
        assert looks_like_magn(prefix)
    for prefix in (b"H", b"HELP\n", b"STATUS\n", b"MA", b"MGNX", b"\x00"):
        assert not looks_like_magn(prefix)


# --- refusals: fatal ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("data", [b"X", b"H", b"MX", b"MGX", b"MGNX", b"GET / HTTP/1.1\r\n", b"\x00" * 10])
def test_bad_magic_is_refused_as_soon_as_a_prefix_cannot_be_magic(data: bytes) -> None:
    parser = FrameParser()
    parser.receive_data(data)
    with pytest.raises(RemoteProtocolError) as info:
        parser.next_event()
    assert info.value.code == "BAD_MAGIC" and info.value.fatal
    assert parser.state is ParserState.ERROR
    with pytest.raises(RemoteProtocolError):  # the parser refuses all further data
        parser.receive_data(GOLDEN[0][1])
    with pytest.raises(RemoteProtocolError):
        parser.next_event()


def test_bad_magic_after_a_good_frame() -> None:
    frames, parser = parse_all(GOLDEN[0][1], chunks=[1])
    parser.receive_data(b"Z")
    with pytest.raises(RemoteProtocolError, match="BAD_MAGIC"):
        parser.next_event()
    assert len(frames) == 1


@pytest.mark.parametrize("version", [0, 2, 0xFFFF])
def test_unsupported_version_is_refused_with_only_six_bytes(version: int) -> None:
    parser = FrameParser()
    parser.receive_data(struct.pack(">IH", MAGIC, version))
    with pytest.raises(RemoteProtocolError) as info:
        parser.next_event()
    assert info.value.code == "UNSUPPORTED_VERSION" and info.value.fatal
    assert info.value.error.details == {"version": version, "supported": [1]}
    assert parser.state is ParserState.ERROR


def test_oversize_is_refused_from_the_header_alone() -> None:
    parser = FrameParser(max_frame_bytes=100)
    parser.receive_data(struct.pack(">IHI", MAGIC, VERSION, 101))  # no payload byte at all
    with pytest.raises(RemoteProtocolError) as info:
        parser.next_event()
    assert info.value.code == "FRAME_TOO_LARGE" and info.value.fatal
    assert info.value.error.details == {"length": 101, "max_frame_bytes": 100}
    huge = FrameParser()
    huge.receive_data(struct.pack(">IHI", MAGIC, VERSION, 0xFFFFFFFF))
    with pytest.raises(RemoteProtocolError, match="FRAME_TOO_LARGE"):
        huge.next_event()


def test_a_frame_of_exactly_max_frame_bytes_is_accepted() -> None:
    wire = GOLDEN[0][1]
    frames, _ = parse_all(wire, max_frame_bytes=len(wire) - HEADER.size)
    assert frames == [Frame(GOLDEN[0][0])]


def test_end_of_stream_inside_a_frame_is_fatal() -> None:
    error = refused(GOLDEN[0][1][:-1], eof=True)
    assert error.code == "BAD_PAYLOAD" and error.fatal and error.error.details["reason"] == "truncated frame"
    error = refused(GOLDEN[0][1][:3], eof=True)
    assert error.fatal


# --- refusals: recoverable BAD_PAYLOAD ------------------------------------------------------------------------------

BAD_PAYLOADS = {
    "bad base64": (frame_of(b"!!!!"), "base64"),
    "base64 with whitespace": (frame_of(b"e30=\n"), "base64"),
    "bad padding": (frame_of(b"e30"), "base64"),
    "not utf-8": (raw_frame(b"\xff\xfe{}"), "utf-8"),
    "not json": (raw_frame(b"hello"), "json"),
    "empty payload": (frame_of(b""), "json"),
    "json array": (raw_frame(b"[1, 2]"), "json"),
    "json string": (raw_frame(b'"text"'), "json"),
    "json number": (raw_frame(b"1"), "json"),
    "json null": (raw_frame(b"null"), "json"),
    "NaN": (raw_frame(b'{"a": NaN}'), "json"),
    "Infinity": (raw_frame(b'{"a": -Infinity}'), "json"),
    "float overflow": (raw_frame(b'{"a": 1e999}'), "json"),
    "int over 64 bits": (raw_frame(b'{"a": 18446744073709551616}'), "json"),
    "int of 5000 digits": (raw_frame(b'{"a": ' + b"9" * 5000 + b"}"), "json"),
    "lone surrogate": (raw_frame(b'{"a": "\\ud800"}'), "json"),
    "too deep": (raw_frame(b'{"a": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}"), "json"),
    "recursion bomb": (raw_frame(b"[" * 100_000), "json"),
    "truncated json": (raw_frame(b'{"a": '), "json"),
}


@pytest.mark.parametrize(("wire", "stage"), BAD_PAYLOADS.values(), ids=BAD_PAYLOADS.keys())
def test_bad_payload_is_recoverable(wire: bytes, stage: str) -> None:
    parser = FrameParser()
    parser.receive_data(wire + GOLDEN[0][1])
    with pytest.raises(RemoteProtocolError) as info:
        parser.next_event()
    assert info.value.code == "BAD_PAYLOAD" and not info.value.fatal
    assert info.value.error.details["stage"] == stage
    assert parser.state is ParserState.HEADER  # the bad frame was consumed; framing is intact
    assert parser.next_event() == Frame(GOLDEN[0][0])


def test_depth_limit_is_exactly_max_json_depth() -> None:
    nested = b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"  # innermost: depth 64
    expected: list = []
    for _ in range(MAX_JSON_DEPTH - 2):
        expected = [expected]
    assert parse_all(raw_frame(nested))[0] == [Frame({"a": expected})]


# --- the encoder refuses what it cannot send -------------------------------------------------------------------------

@pytest.mark.parametrize("payload", [
    [1], "s", None, {1: "int key"}, {"a": float("nan")}, {"a": float("inf")}, {"a": {1, 2}}, {"a": (1, 2)},
    {"a": b"bytes"}, {"a": 2**64}, {"a": "\ud800"}, {"a": object()},
], ids=repr)
def test_encoder_refuses_what_is_not_strict_json(payload: object) -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode_frame(payload)  # type: ignore[arg-type]
    assert info.value.code == "BAD_PAYLOAD"


@pytest.mark.parametrize(("payload", "field", "reason", "limit"), [
    ({"a": {"b": [1, float("nan")]}}, "a.b[1]", "number is not finite", {}),
    ({"a": [{"b": 2**64}]}, "a[0].b", "integer out of the 64-bit range", {"min": -(2**63), "max": 2**64 - 1}),
    ({"a": {"\ud800": 1}}, "a", "string is not valid Unicode", {}),
    ({"a": {2: 1}}, "a", "object key 2 is not a string", {}),
    ({"a": (1,)}, "a", "tuple is not a JSON type", {}),
], ids=repr)
def test_encoder_names_the_offending_value(payload: dict, field: str, reason: str, limit: dict) -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode_frame(payload)
    assert info.value.error.details == {"field": field, "reason": reason, **limit}
    assert info.value.error.message == f"{field}: {reason}"


def test_encoder_refusal_of_the_payload_itself_has_no_field() -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode_frame([1])  # type: ignore[arg-type]
    assert info.value.error.details == {"field": None, "reason": "payload is not a JSON object"}
    assert info.value.error.message == "payload: payload is not a JSON object"


def test_a_value_outside_strict_json_in_a_received_frame_names_its_field() -> None:
    wire = raw_frame(b'{"a": {"b": 1e999}}') + GOLDEN[0][1]
    parser = FrameParser()
    parser.receive_data(wire)
    with pytest.raises(RemoteProtocolError) as info:
        parser.next_event()
    assert info.value.error.details == {"stage": "json", "field": "a.b", "reason": "a.b: number is not finite"}
    assert parser.next_event() == Frame(GOLDEN[0][0]) and parser.last_length == len(GOLDEN[0][1]) - HEADER.size


def test_encoder_limits() -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode_frame({"prompt": "x" * 100}, max_frame_bytes=100)
    assert info.value.code == "FRAME_TOO_LARGE"
    for version in (-1, 0x10000, True, "1"):
        with pytest.raises(LocalProtocolError, match="UNSUPPORTED_VERSION"):
            encode_frame({}, version=version)  # type: ignore[arg-type]


def test_an_unsupported_version_can_be_encoded_to_test_a_peer() -> None:
    wire = encode_frame({}, version=2)
    assert wire[4:6] == b"\x00\x02"
    assert refused(wire).code == "UNSUPPORTED_VERSION"


# --- payload limits: refused before (or while) the JSON is parsed, naming the limit ---------------------------------

def _array_of(item: bytes, count: int) -> bytes:
    return b'{"a": [' + b",".join([item] * count) + b"]}"


LIMITS = {
    "wide array": (_array_of(b"1", MAX_JSON_ITEMS + 2), {"max_json_items": MAX_JSON_ITEMS}),
    "array of empty arrays": (_array_of(b"[]", MAX_JSON_ITEMS), {"max_json_items": MAX_JSON_ITEMS}),
    "array of empty strings": (_array_of(b'""', MAX_JSON_ITEMS + 2), {"max_json_items": MAX_JSON_ITEMS}),
    "object of many keys": (b"{" + b",".join(b'"k%d":0' % i for i in range(MAX_JSON_ITEMS + 2)) + b"}",
                            {"max_json_items": MAX_JSON_ITEMS}),
    "brackets without end": (b"[" * (MAX_JSON_ITEMS + 1), {"max_json_items": MAX_JSON_ITEMS}),
    "int of 21 digits": (b'{"a": ' + b"1" * (MAX_JSON_INT_DIGITS + 1) + b"}", {"max_int_digits": MAX_JSON_INT_DIGITS}),
    "negative int of 5000 digits": (b'{"a": -' + b"9" * 5000 + b"}", {"max_int_digits": MAX_JSON_INT_DIGITS}),
    "nested past the recursion limit": (b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", {"max_depth": MAX_JSON_DEPTH}),
    "nested past the depth limit": (b'{"a": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}",
                                    {"max_depth": MAX_JSON_DEPTH}),
    "int past 64 bits": (b'{"a": 18446744073709551616}', {"min": -(2**63), "max": 2**64 - 1}),
}


@pytest.mark.parametrize(("payload", "limit"), LIMITS.values(), ids=LIMITS.keys())
def test_a_payload_past_a_limit_is_a_recoverable_bad_payload_naming_the_limit(payload: bytes, limit: dict) -> None:
    error = refused(raw_frame(payload) + GOLDEN[0][1])
    assert error.code == "BAD_PAYLOAD" and not error.fatal
    assert error.error.details["stage"] == "json"
    assert {key: error.error.details.get(key) for key in limit} == limit


@pytest.mark.parametrize("payload", [
    _array_of(b"1", MAX_JSON_ITEMS - 1),
    _array_of(b'"[,{"', MAX_JSON_ITEMS // 4),  # brackets and commas in strings do not count
    b'{"a": "' + b"[{," * MAX_JSON_ITEMS + b'"}',
    b'{"a": "' + b'\\\"[' * MAX_JSON_ITEMS + b'"}',  # escaped quotes and backslashes do not end the string
    b'{"a": ' + b"1" * MAX_JSON_INT_DIGITS + b', "b": -' + b"9" * 18 + b"}",
], ids=["items at the limit", "strings holding brackets", "one string of brackets", "escaped quotes", "long ints"])
def test_payloads_within_the_limits_are_accepted(payload: bytes) -> None:
    frames, _ = parse_all(raw_frame(payload + b" "))
    assert frames and frames[0].payload == json.loads(payload)


def test_a_payload_too_wide_to_be_accepted_is_refused_by_the_encoder_too() -> None:
    with pytest.raises(LocalProtocolError) as info:
        encode_frame({"a": [0] * (MAX_JSON_ITEMS + 1)})
    assert info.value.error.details["max_json_items"] == MAX_JSON_ITEMS


JSON_TEXT = st.recursive(st.none() | st.integers() | st.text(alphabet='[]{},:"\\ab'),
                         lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text('[{,"\\'), kids,
                                                                                   max_size=4), max_leaves=30)


@given(JSON_TEXT, st.booleans(), st.sampled_from([0, 1, 3, 8]))
def test_count_json_items_is_above_the_limit_exactly_when_the_structure_is(value: object, indent: bool,
                                                                           limit: int) -> None:
    """Brackets, braces and commas inside strings (escaped quotes and backslashes too) are never counted against
    the limit (here lowered, to reach the exact count's path)."""
    text = json.dumps(value, indent=1 if indent else None)
    structure = json.dumps(_skeleton(value))  # the same value with every string emptied
    expected = structure.count("[") + structure.count("{") + structure.count(",")
    with mock.patch.object(frames, "MAX_JSON_ITEMS", limit):
        assert (count_json_items(text) > limit) == (expected > limit)


def _skeleton(value: object) -> object:
    if isinstance(value, str):
        return ""
    if isinstance(value, list):
        return [_skeleton(item) for item in value]
    if isinstance(value, dict):
        return {str(index): _skeleton(item) for index, item in enumerate(value.values())}
    return value


def test_a_16_mib_frame_of_nested_arrays_is_refused_quickly() -> None:
    """Was 4.6 s on the event loop (issue #8); now the structure is counted at C speed first."""
    import time

    payload = b'{"a": [' + b"[[]]," * ((12 * 1024 * 1024 - 64) // 5) + b"[]]}"
    wire = raw_frame(payload)
    assert len(wire) > 15 * 1024 * 1024
    started = time.perf_counter()
    error = refused(wire)
    elapsed = time.perf_counter() - started
    assert error.error.details["max_json_items"] == MAX_JSON_ITEMS
    assert elapsed < 2.0, f"took {elapsed:.2f} s"  # about 0.1 s; a loose bound for a slow, busy machine


def test_pending_frame_bytes_announces_the_frame_before_it_is_complete() -> None:
    wire = GOLDEN[0][1]
    parser = FrameParser()
    assert parser.pending_frame_bytes == parser.buffered_bytes == 0
    parser.receive_data(wire[:4])
    assert parser.pending_frame_bytes == parser.buffered_bytes == 4
    parser.receive_data(wire[4:12])
    assert parser.pending_frame_bytes == len(wire) and parser.buffered_bytes == 12
    assert parser.next_event() is NEED_DATA
    assert parser.pending_frame_bytes == len(wire)
    parser.receive_data(wire[12:] + wire[:3])
    assert parser.buffered_bytes == len(wire) + 3
    assert parser.next_event() == Frame(GOLDEN[0][0])
    assert parser.pending_frame_bytes == parser.buffered_bytes == 3


# --- fuzzing -----------------------------------------------------------------------------------------------------

JSON_SCALARS = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=False,
                                                                                      allow_infinity=False) | st.text()
JSON = st.recursive(JSON_SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(), kids,
                                                                                            max_size=4), max_leaves=20)
OBJECTS = st.dictionaries(st.text(), JSON, max_size=5)
VALID_FRAMES = OBJECTS.map(encode_frame)
HEADERS = st.builds(lambda v, n, body: struct.pack(">IHI", MAGIC, v, n) + body,
                    st.sampled_from([0, 1, 1, 1, 2]), st.integers(0, 64), st.binary(max_size=64))
STREAMS = st.lists(VALID_FRAMES | HEADERS | st.binary(max_size=32), max_size=6).map(b"".join)
CHUNKS = st.lists(st.integers(1, 17), min_size=1, max_size=8)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.binary(max_size=200) | STREAMS, chunks=CHUNKS, eof=st.booleans())
def test_any_bytes_in_any_chunking_yield_frames_or_a_protocol_error(data: bytes, chunks: list[int],
                                                                    eof: bool) -> None:
    try:
        frames, _ = parse_all(data, chunks=chunks, eof=eof)
    except RemoteProtocolError as exc:
        assert exc.error.code in {"BAD_MAGIC", "UNSUPPORTED_VERSION", "FRAME_TOO_LARGE", "BAD_PAYLOAD"}
        return
    for frame in frames:  # whatever came out re-encodes to the same frame
        assert parse_all(frame.to_bytes())[0] == [frame]


@settings(max_examples=200, deadline=None)
@given(payload=OBJECTS, chunks=CHUNKS)
def test_encode_then_decode_round_trips_json_objects(payload: dict, chunks: list[int]) -> None:
    frames, parser = parse_all(encode_frame(payload) * 2, chunks=chunks)
    assert [f.payload for f in frames] == [payload, payload]
    assert parser.trailing_data == b""


@settings(max_examples=100, deadline=None)
@given(frames=st.lists(OBJECTS, min_size=1, max_size=4), garbage=st.binary(min_size=1, max_size=40))
def test_bad_payload_frames_between_good_ones_do_not_break_the_stream(frames: list[dict], garbage: bytes) -> None:
    bad = frame_of(b"*" + base64.b64encode(garbage))  # "*" is never base64
    wire = b"".join(encode_frame(p) + bad for p in frames)
    parser, good = FrameParser(), []
    parser.receive_data(wire)
    for _ in range(2 * len(frames)):
        try:
            good.append(parser.next_event())
        except RemoteProtocolError as exc:
            assert not exc.fatal
    assert [f.payload for f in good] == frames


@pytest.mark.parametrize("at", [0, (1 << 18) - 1, 1 << 18, 3 * (1 << 18) + 5, -1])
def test_a_lone_surrogate_anywhere_in_a_long_string_is_found(at: int) -> None:
    """The surrogate search goes piece by piece over long text: one at a piece's edge or at the end is found,
    in a value and in a frame's decoded payload alike."""
    chars = list("h\u00e9llo w\u00f6rld " * 100_000)
    assert is_valid_unicode("".join(chars))
    chars[at] = "\ud800"
    text = "".join(chars)
    assert not is_valid_unicode(text)
    with pytest.raises(LocalProtocolError) as caught:
        Frame({"prompt": text})
    assert caught.value.error.details["field"] == "prompt"
    body = base64.b64encode(json.dumps({"prompt": text}).encode())  # \ud800 escaped: valid JSON, then refused
    parser = FrameParser()
    parser.receive_data(frame_of(body))
    with pytest.raises(RemoteProtocolError) as refused:
        parser.next_event()
    assert refused.value.code == "BAD_PAYLOAD" and not refused.value.fatal


def test_a_big_payload_s_structure_is_counted_across_its_base64_pieces() -> None:
    """The structure count of a payload past the base64 piece size is the whole text's: a frame of commas just
    over the limit, spread over many pieces, is refused; one just under it is parsed."""
    pad = "x" * (1 << 20)
    under = {"pad": pad, "stop": [""] * (MAX_JSON_ITEMS - 2)}  # "{", "[", one comma before "stop", n - 1 in the list
    over = {"pad": pad, "stop": [""] * (MAX_JSON_ITEMS - 1)}
    parser = FrameParser()
    parser.receive_data(frame_of(base64.b64encode(json.dumps(under, separators=(",", ":")).encode())))
    assert parser.next_event().payload == under
    parser.receive_data(frame_of(base64.b64encode(json.dumps(over, separators=(",", ":")).encode())))
    with pytest.raises(RemoteProtocolError) as refused:
        parser.next_event()
    assert refused.value.error.details["max_json_items"] == MAX_JSON_ITEMS
