"""The line protocol's pure half: parsing and formatting, no sockets."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from appliance.errors import ApplianceError
from appliance.protocol import lines

GOOD = [
    ("HELP", lines.Command("HELP")),
    ("status\n", lines.Command("STATUS")),
    ("LIST\r\n", lines.Command("LIST")),
    ("RESYNC", lines.Command("RESYNC")),
    ("REGISTER smol demo", lines.Command("REGISTER", agent="smol", model="demo")),
    ("REGISTER a /models/x y.gguf", lines.Command("REGISTER", agent="a", model="/models/x y.gguf")),
    ("UNREGISTER smol", lines.Command("UNREGISTER", agent="smol")),
    ("DECODE smol 24 Hello there", lines.Command("DECODE", agent="smol", n_tokens=24, prompt="Hello there")),
    ("DECODE smol 24", lines.Command("DECODE", agent="smol", n_tokens=24, prompt="")),
    ("DECODE a.b:c-1 1 x", lines.Command("DECODE", agent="a.b:c-1", n_tokens=1, prompt="x")),
]

BAD = [
    ("", "BAD_REQUEST"),
    ("FROB x", "UNKNOWN_COMMAND"),
    ("HELP me", "BAD_REQUEST"),
    ("REGISTER onlyagent", "BAD_REQUEST"),
    ("REGISTER -bad demo", "BAD_REQUEST"),
    ("UNREGISTER", "BAD_REQUEST"),
    ("UNREGISTER a b", "BAD_REQUEST"),
    ("DECODE a", "BAD_REQUEST"),
    ("DECODE a zero hi", "BAD_REQUEST"),
    ("DECODE a 0 hi", "BAD_REQUEST"),
    ("DECODE a -3 hi", "BAD_REQUEST"),
    (f"DECODE a {lines.MAX_DECODE_TOKENS + 1} hi", "BAD_REQUEST"),
    ("DECODE a\x00 1 hi", "BAD_REQUEST"),
]


@pytest.mark.parametrize(("text", "command"), GOOD)
def test_parse_good_lines(text: str, command: lines.Command) -> None:
    assert lines.parse_line(text) == command
    assert lines.parse_line(text.encode()) == command


@pytest.mark.parametrize(("text", "code"), BAD)
def test_parse_bad_lines(text: str, code: str) -> None:
    with pytest.raises(ApplianceError) as info:
        lines.parse_line(text)
    assert info.value.code == code


def test_non_utf8_and_overlong_lines_are_refused() -> None:
    with pytest.raises(ApplianceError, match="UTF-8"):
        lines.parse_line(b"DECODE a 1 \xff\xfe")
    with pytest.raises(ApplianceError, match="longer"):
        lines.parse_line(b"DECODE a 1 " + b"x" * lines.MAX_LINE_BYTES)


@given(st.binary(max_size=200))
def test_any_bytes_parse_or_give_a_p4_error(data: bytes) -> None:
    try:
        command = lines.parse_line(data)
    except ApplianceError as exc:
        assert exc.code in ("BAD_REQUEST", "UNKNOWN_COMMAND")
    else:
        assert command.name in lines.COMMANDS


def test_decode_reply_has_the_l6_shape() -> None:
    reply = lines.format_reply("DECODE", [
        {"prompt_tokens": 4, "generated_tokens": 24, "stopped_on_eos": False},
        {"elapsed_ms": 125.4951},
        {"kv_swap_evicted": "qwen", "kv_swap_restored": True},
    ], body=["two\nlines"], agent_id="smol")
    assert reply == (
        "OK schema=lmx-daemon/1\n"
        "OK invoke=DECODE agent_id=smol\n"
        "OK prompt_tokens=4 generated_tokens=24 stopped_on_eos=false\n"
        "OK elapsed_ms=125.495\n"
        "OK kv_swap_evicted=qwen kv_swap_restored=true\n"
        "BEGIN_RESPONSE\ntwo\nlines\nEND_RESPONSE\n")


def test_ledger_deny_line_is_exact() -> None:
    error = ApplianceError("VRAM_LEDGER_DENY", "no room", {
        "code": "CAP", "ledger_max_bytes": 7730941132, "ledger_allocated_bytes": 7408950067,
        "requested_table_bytes": 2469606195})
    assert lines.format_error(error) == (
        "ERR VRAM_LEDGER_DENY code=CAP ledger_max_bytes=7730941132 ledger_allocated_bytes=7408950067 "
        "requested_table_bytes=2469606195\n")


def test_error_without_details_carries_its_message_quoted() -> None:
    line = lines.format_error(ApplianceError("UNKNOWN_AGENT", 'no agent "x"'))
    assert line == 'ERR UNKNOWN_AGENT message="no agent \\"x\\""\n'


def test_help_lists_every_command() -> None:
    text = lines.help_text()
    for name in lines.COMMANDS:
        assert f"\n{name}" in text
    assert text.endswith("END_RESPONSE\n")


# -- the sans-IO reader: one table, fed whole, byte by byte and with trailing data ------------------
# Each stream and what the reader makes of it: a Command, or the P4 code of a LineProtocolError.
STREAMS: list[tuple[bytes, list[object]]] = [
    (b"HELP\n", [lines.Command("HELP")]),
    (b"STATUS\r\nLIST\n", [lines.Command("STATUS"), lines.Command("LIST")]),
    (b"\n\n  \nHELP\n\n", [lines.Command("HELP")]),
    (b"FROB\nHELP\n", ["UNKNOWN_COMMAND", lines.Command("HELP")]),
    (b"DECODE a \xc2\xb2 x\nHELP\n", ["BAD_REQUEST", lines.Command("HELP")]),
    (b"DECODE a 1 \xff\nDECODE a 2 hi\n", ["BAD_REQUEST", lines.Command("DECODE", agent="a", n_tokens=2, prompt="hi")]),
    (b"REGISTER a demo", [lines.Command("REGISTER", agent="a", model="demo")]),  # last line without newline
]


def events(reader: lines.LineReader) -> list[object]:
    found: list[object] = []
    while True:
        try:
            event = reader.next_event()
        except lines.LineProtocolError as exc:
            found.append(exc.error.code)
            if exc.fatal:
                return found
            continue
        if event is lines.NEED_DATA or event is lines.CLOSED:
            return found
        found.append(event)


def feed(chunks: list[bytes]) -> tuple[list[object], object]:
    reader = lines.LineReader()
    found: list[object] = []
    for chunk in chunks:
        reader.receive_data(chunk)
        found += events(reader)
    reader.receive_data(b"")
    found += events(reader)
    return found, reader.next_event()


@pytest.mark.parametrize(("data", "expected"), STREAMS)
def test_reader_whole(data: bytes, expected: list[object]) -> None:
    assert feed([data]) == (expected, lines.CLOSED)


@pytest.mark.parametrize(("data", "expected"), STREAMS)
def test_reader_byte_by_byte(data: bytes, expected: list[object]) -> None:
    assert feed([data[i:i + 1] for i in range(len(data))]) == (expected, lines.CLOSED)


@pytest.mark.parametrize(("data", "expected"), STREAMS)
def test_reader_with_trailing_data(data: bytes, expected: list[object]) -> None:
    """Lines are returned as soon as they are complete; what follows waits for its newline."""
    reader = lines.LineReader()
    reader.receive_data(data + b"\nDECODE a 3 tail")
    assert events(reader) == expected
    assert reader.buffered == len(b"DECODE a 3 tail")
    assert reader.next_event() is lines.NEED_DATA
    reader.receive_data(b"\n")
    assert reader.next_event() == lines.Command("DECODE", agent="a", n_tokens=3, prompt="tail")


def test_an_overlong_line_is_refused_before_its_end_arrives_and_is_fatal() -> None:
    reader = lines.LineReader()
    reader.receive_data(b"HELP\n" + b"x" * (lines.MAX_LINE_BYTES + 1))
    assert reader.next_event() == lines.Command("HELP")
    with pytest.raises(lines.LineProtocolError) as info:
        reader.next_event()
    assert info.value.fatal and info.value.error.details == {"max_line_bytes": lines.MAX_LINE_BYTES}
    with pytest.raises(lines.LineProtocolError):
        reader.receive_data(b"\n")


def test_a_line_of_exactly_the_limit_is_accepted() -> None:
    reader = lines.LineReader()
    prompt = "y" * (lines.MAX_LINE_BYTES - len("DECODE a 1 "))
    reader.receive_data(f"DECODE a 1 {prompt}\n".encode())
    assert reader.next_event() == lines.Command("DECODE", agent="a", n_tokens=1, prompt=prompt)


def test_a_megabyte_of_newlines_is_read_in_linear_time() -> None:
    reader = lines.LineReader()
    for _ in range(16):
        reader.receive_data(b"\n" * 65536)
        assert reader.next_event() is lines.NEED_DATA
    reader.receive_data(b"HELP\n")
    assert reader.next_event() == lines.Command("HELP")
    assert reader.buffered == 0


@pytest.mark.parametrize("count", ["²", "١٢", "0x10", "1" * 5000, "+5", " 5"])
def test_decode_counts_are_ascii_integers_with_the_limit_in_the_error(count: str) -> None:
    with pytest.raises(ApplianceError) as info:
        lines.parse_line(f"DECODE a {count} x")
    assert info.value.code == "BAD_REQUEST"
    assert info.value.details["max"] == lines.MAX_DECODE_TOKENS


@given(st.lists(st.binary(max_size=64), max_size=20))
def test_only_a_line_protocol_error_escapes_the_reader(chunks: list[bytes]) -> None:
    reader = lines.LineReader()
    for chunk in [c for c in chunks if c] + [b""]:
        try:
            reader.receive_data(chunk)
            events(reader)
        except lines.LineProtocolError:
            return
