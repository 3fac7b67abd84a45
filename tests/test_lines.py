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


# -- replies cannot be forged: the body is escaped; one table, encoded and decoded ---------------------------------
# Each body text (what a model may generate) and its body lines on the wire.
BODIES: list[tuple[str, list[str]]] = [
    ("", [""]),
    ("plain text", ["plain text"]),
    ("two\nlines", ["two", "lines"]),
    ("ends with a newline\n", ["ends with a newline", ""]),
    ("\n\n", ["", "", ""]),
    ("END_RESPONSE", ["\\END_RESPONSE"]),
    ("x\nEND_RESPONSE\nERR INTERNAL forged=1\n", ["x", "\\END_RESPONSE", "\\ERR INTERNAL forged=1", ""]),
    ("BEGIN_RESPONSE", ["\\BEGIN_RESPONSE"]),
    ("OK schema=lmx-daemon/1", ["\\OK schema=lmx-daemon/1"]),
    ("OKAY", ["\\OKAY"]),
    ("  END_RESPONSE", ["\\  END_RESPONSE"]),
    ("\tERR x", ["\\\tERR x"]),
    ("not OK at the start", ["not OK at the start"]),
    ("back\\slash", ["back\\\\slash"]),
    ("\\", ["\\\\"]),
    ("\\END_RESPONSE", ["\\\\END_RESPONSE"]),
    ("\\r is not a CR", ["\\\\r is not a CR"]),
    ("a\rEND_RESPONSE", ["a\\rEND_RESPONSE"]),
    ("crlf\r\n", ["crlf\\r", ""]),
    ("\x1b[31mred\x1b[0m", ["\\x1b[31mred\\x1b[0m"]),
    ("nul\x00 del\x7f nel\x85", ["nul\\x00 del\\x7f nel\\x85"]),
    ("vt\x0bff\x0cfs\x1c", ["vt\\x0bff\\x0cfs\\x1c"]),
    ("ls\u2028END_RESPONSE\u2029", ["ls\\u2028END_RESPONSE\\u2029"]),
    ("tab\tstays", ["tab\tstays"]),
    ("é ü 日本 🙂", ["é ü 日本 🙂"]),
    ("no final newline", ["no final newline"]),
]

FORGERY = "ERR INTERNAL forged=1"


def wire_reply(body: str) -> bytes:
    return lines.format_reply("DECODE", [{"generated_tokens": 3}], body=[body], agent_id="a").encode()


def body_lines_on_the_wire(wire: bytes) -> list[str]:
    rows = wire.decode().split("\n")
    return rows[rows.index("BEGIN_RESPONSE") + 1: -2]


def read_replies(chunks: list[bytes]) -> list[lines.Reply]:
    reader = lines.ReplyReader()
    replies: list[lines.Reply] = []
    for chunk in [*chunks, b""]:
        reader.receive_data(chunk)
        while True:
            event = reader.next_event()
            if event is lines.NEED_DATA:
                break
            if event is lines.CLOSED:
                return replies
            replies.append(event)
    raise AssertionError("the reader never reported CLOSED")


@pytest.mark.parametrize(("body", "on_the_wire"), BODIES, ids=repr)
def test_body_escaping_encodes_as_the_table_says(body: str, on_the_wire: list[str]) -> None:
    wire = wire_reply(body)
    assert body_lines_on_the_wire(wire) == on_the_wire
    assert wire.endswith(b"\nEND_RESPONSE\n")


@pytest.mark.parametrize(("body", "on_the_wire"), BODIES, ids=repr)
def test_body_escaping_decodes_whole(body: str, on_the_wire: list[str]) -> None:
    [reply] = read_replies([wire_reply(body)])
    assert reply.body == body and reply.fields["generated_tokens"] == "3" and reply.error is None
    assert lines.parse_reply(wire_reply(body).decode()).body == body


@pytest.mark.parametrize(("body", "on_the_wire"), BODIES, ids=repr)
def test_body_escaping_decodes_byte_by_byte(body: str, on_the_wire: list[str]) -> None:
    wire = wire_reply(body)
    [reply] = read_replies([wire[i:i + 1] for i in range(len(wire))])
    assert reply.body == body


@pytest.mark.parametrize(("body", "on_the_wire"), BODIES, ids=repr)
def test_body_escaping_decodes_with_trailing_replies(body: str, on_the_wire: list[str]) -> None:
    """Pipelined: the hostile body, then an ERR and another reply; each is read whole, none is forged."""
    error = lines.format_error(ApplianceError("UNKNOWN_AGENT", "no such agent", {"agent": "b"})).encode()
    replies = read_replies([wire_reply(body) + error + wire_reply("after")])
    assert [reply.body for reply in replies] == [body, None, "after"]
    assert replies[1].error is not None and replies[1].error.code == "UNKNOWN_AGENT"


def naive_read_until_end(text: str) -> list[str]:
    """What a shell user's loop sees: lines (split any way Python does) up to the first END_RESPONSE."""
    seen: list[str] = []
    for line in text.splitlines():
        if line.strip() == "END_RESPONSE":
            return seen
        seen.append(line)
    raise AssertionError("no END_RESPONSE")


PIECES = st.text(max_size=8) | st.sampled_from(["END_RESPONSE", FORGERY, "BEGIN_RESPONSE", "OK ", "\\", "\r", "\n"])


@given(st.lists(PIECES, max_size=12).map("".join))
def test_no_body_can_end_a_reply_early_or_forge_a_line(body: str) -> None:
    text = wire_reply(body).decode()
    assert text.split("\n") == text.splitlines() + [""], "no line break but \\n in a reply"
    seen = naive_read_until_end(text)
    assert len(seen) == text.count("\n") - 1, "the reader stopped at the real END_RESPONSE, not before"
    in_body = seen[seen.index("BEGIN_RESPONSE") + 1:]
    assert not any(line.lstrip(" \t").startswith(lines.MARKERS) for line in in_body)
    assert lines.parse_reply(text).body == body


@given(st.lists(st.text(), max_size=4))
def test_status_style_bodies_round_trip_as_their_lines_joined(texts: list[str]) -> None:
    text = lines.format_reply("STATUS", body=texts)
    parsed = lines.parse_reply(text).body
    assert parsed == ("\n".join(texts) if texts else None)


def test_help_and_records_are_unchanged_by_escaping() -> None:
    record = lines.format_records("model", [{"name": "demo", "path": "/m/a b.gguf", "loaded": True}])
    assert record == ['model name=demo path="/m/a b.gguf" loaded=true']
    reply = lines.format_reply("STATUS", body=record)
    assert reply.split("\n")[3] == record[0]
    assert lines.parse_reply(lines.help_text()).body == "\n".join(lines.COMMANDS.values())


# -- values: lists as lists, quoting and escaping that round-trip ---------------------------------------------------
VALUES: list[tuple[object, str, str]] = [
    (["demo", "demo-wide"], "demo,demo-wide", "demo,demo-wide"),
    (("a",), "a", "a"),
    ([], '""', ""),
    ({"b", "a"}, "a,b", "a,b"),
    ({"device": 1, "host": 2}, "device:1,host:2", "device:1,host:2"),
    (["a b", "c"], '"a b,c"', "a b,c"),
    (None, "none", "none"),
    (True, "true", "true"),
    (1.23456, "1.235", "1.235"),
    (8192, "8192", "8192"),
    ("plain", "plain", "plain"),
    ("two words", '"two words"', "two words"),
    ('say "hi"', '"say \\"hi\\""', 'say "hi"'),
    ("a=b", '"a=b"', "a=b"),
    ("back\\slash", '"back\\\\slash"', "back\\slash"),
    ("cr\rlf\nend", '"cr\\rlf\\nend"', "cr\rlf\nend"),
    ("esc\x1b", '"esc\\x1b"', "esc\x1b"),
    ("", '""', ""),
]


@pytest.mark.parametrize(("value", "text", "read_back"), VALUES, ids=repr)
def test_values_are_formatted_and_read_back(value: object, text: str, read_back: str) -> None:
    assert lines.format_value(value) == text
    assert lines.parse_fields(f"k={text} next=1") == {"k": read_back, "next": "1"}


def test_an_err_line_with_a_list_and_a_hostile_value_reads_back() -> None:
    error = ApplianceError("UNKNOWN_MODEL", "no such model", {"model": "x\r\nERR FORGED", "known": ["demo", "demo-b"]})
    line = lines.format_error(error)
    assert line == 'ERR UNKNOWN_MODEL model="x\\r\\nERR FORGED" known=demo,demo-b\n'
    assert line.splitlines() == [line[:-1]]
    parsed = lines.parse_reply(line).error
    assert parsed is not None and parsed.code == "UNKNOWN_MODEL"
    assert parsed.details == {"model": "x\r\nERR FORGED", "known": "demo,demo-b"}


@given(st.text())
def test_any_string_value_round_trips_on_one_line(value: str) -> None:
    text = lines.format_value(value)
    assert "\n" not in text and len(f"k={text}".splitlines()) <= 1
    assert lines.parse_fields(f"k={text}") == {"k": value if value else ""}


def test_a_reply_stream_that_ends_inside_a_reply_is_an_error() -> None:
    reader = lines.ReplyReader()
    reader.receive_data(b"OK schema=lmx-daemon/1\nBEGIN_RESPONSE\npartial")
    assert reader.next_event() is lines.NEED_DATA
    reader.receive_data(b"")
    with pytest.raises(ValueError, match="inside a reply"):
        reader.next_event()


# -- fuzz: hostile request lines give a Command or a one-line BAD_REQUEST/UNKNOWN_COMMAND that reads back ---------
LINE_PIECES = st.sampled_from(["DECODE", "REGISTER", "UNREGISTER", "STATUS", "decode", " ", "  ", "a", "demo", "x",
                               "²", "٣", "0x10", "+5", "-1", "0", "1", "8192", "8193", "9" * 5000, "1e3", "\r",
                               "\x00", "\x1b", "END_RESPONSE", "ERR", '"', "\\", "=", "\u2028", "é"])


@given(st.lists(LINE_PIECES | st.text(max_size=6), max_size=8).map("".join))
def test_any_line_parses_or_gets_an_err_line_that_reads_back(text: str) -> None:
    try:
        command = lines.parse_line(text.encode("utf-8", "surrogatepass"))
    except ApplianceError as exc:
        assert exc.code in ("BAD_REQUEST", "UNKNOWN_COMMAND")
        line = lines.format_error(exc)
        assert line.endswith("\n") and len(line.splitlines()) == 1 and len(line) < 1024
        parsed = lines.parse_reply(line).error
        assert parsed is not None and parsed.code == exc.code
        if exc.details.get("max") is not None:
            assert parsed.details["max"] == str(lines.MAX_DECODE_TOKENS)
    else:
        assert command.name in lines.COMMANDS
        if command.n_tokens is not None:
            assert 1 <= command.n_tokens <= lines.MAX_DECODE_TOKENS
