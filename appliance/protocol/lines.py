r"""The line protocol (SPEC L6, schema ``lmx-daemon/1``): pure parsing and formatting, no sockets.

A request is one line. :class:`LineReader` is the sans-IO reader (h11 style): ``receive_data`` bytes as they
come, ``next_event`` returns each :class:`Command`, :data:`NEED_DATA` or :data:`CLOSED`, and raises
:class:`LineProtocolError` for a bad line (not fatal: the next line is read as usual) or a line longer than
:data:`MAX_LINE_BYTES` (fatal: the framing is lost, answer and close). Counts are ASCII digits only, at most
:data:`MAX_DECODE_TOKENS`; a bad one is ``BAD_REQUEST`` whose details name the limit.

Replies
-------

A reply is either one ``ERR`` line, or ``OK`` header lines followed by a body between a ``BEGIN_RESPONSE`` line
and an ``END_RESPONSE`` line; so a client reads lines (split on ``\n`` only) until it sees ``ERR …`` or
``END_RESPONSE``. ``ERR`` lines carry the P4 code, then the error's details as ``key=value``; an error without
details carries its message as ``message="…"``. Every line ends with ``\n``.

Values (:func:`format_value`) are bare when they hold no space, quote, ``=``, backslash or control character,
else quoted: ``"…"`` with ``\\``, ``\"``, ``\n``, ``\r`` and ``\xHH`` / ``\uHHHH`` inside. A list is its
items joined by commas (``known=demo,demo-wide``), a mapping its ``key:value`` pairs joined by commas.

The body is escaped line by line (:func:`escape_body_line`), so that whatever text it carries (a model's
output included) no body line can be read as a reply line or split into several:

- a backslash is written ``\\`` and a carriage return ``\r``;
- every other control character (U+0000-U+001F but tab, U+007F-U+009F) is written ``\xHH``, and the line
  separators U+2028, U+2029 ``\u2028``, ``\u2029``;
- a line that, after its leading spaces and tabs, begins with ``OK``, ``ERR``, ``BEGIN_RESPONSE`` or
  ``END_RESPONSE`` gets one backslash in front.

To read it back (:func:`unescape`, the same for quoted values): ``\r``, ``\n``, ``\xHH`` and ``\uHHHH`` are
those characters, a backslash followed by any other character is that character. The body's text is its lines
unescaped and joined with ``\n`` (an empty text is one empty line; a reply without a body, like REGISTER's, has
no line at all). :func:`parse_reply` reads a whole reply back.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from appliance.config.schema import SETTINGS
from appliance.config.tune import VALUE_WORDS
from appliance.errors import ApplianceError
from appliance.protocol.events import CLOSED, NEED_DATA, Sentinel
from appliance.protocol.identifiers import AGENT_ID_RULE, MAX_AGENT_ID_CHARS, agent_id_problem
from appliance.protocol.paging import MAX_OFFSET_DIGITS, STATUS_AGENTS

SCHEMA = "lmx-daemon/1"
MAX_LINE_BYTES = 64 * 1024
MAX_DECODE_TOKENS = 8192
MAX_COUNT_DIGITS = len(str(MAX_DECODE_TOKENS))

COMMANDS: dict[str, str] = {
    "HELP": "HELP                               this text",
    "STATUS": f"STATUS [agents <offset>]           device, ledger, models and the first {STATUS_AGENTS} agents; "
              f"agents <offset>: only agents, {STATUS_AGENTS} from <offset> on",
    "LIST": "LIST                               configured models and their state",
    "REGISTER": "REGISTER <agent> <model|gguf path>  admit a model (ledger) and give the agent a slot; <agent>: "
                f"{AGENT_ID_RULE}; at most max_agents agents in all",
    "UNREGISTER": "UNREGISTER <agent>                 free the agent's slot (and the model if unused)",
    "DECODE": "DECODE <agent> <n_tokens> [prompt]  generate; an empty prompt continues the conversation; the prompt "
              "is raw text: no chat template, no control tokens (<|im_start|> is its letters), no tools",
    "RESYNC": "RESYNC                             re-read the device and re-base the ledger cap",
    "RELOAD": "RELOAD [benchmark]                 re-read appliance.yaml now (the record says who asked)",
    "TUNE": "TUNE [engine.<key>=<value> ...]     engine settings over the file's while this connection lasts "
            "(none: clear); each value one word without spaces; threads at most the usable cores; anyone who may "
            "open the socket may TUNE (socket.mode, socket.group)",
}


@dataclass(frozen=True)
class Command:
    """One parsed request line."""

    name: str
    agent: str | None = None
    model: str | None = None
    n_tokens: int | None = None
    prompt: str = ""
    trigger: str | None = None  # RELOAD: what the reload record names as its cause
    settings: tuple[tuple[str, str], ...] = ()  # TUNE: (engine key, value as written), in order
    offset: int | None = None  # STATUS agents <offset>: only agents, from this one on (None: the whole STATUS)


def _bad(message: str, **details: Any) -> ApplianceError:
    return ApplianceError("BAD_REQUEST", message, details)


def _agent(text: str) -> str:
    problem = agent_id_problem(text)
    if problem is not None:
        raise _bad(f"agent id {problem}", agent=text[:80], max_agent_chars=MAX_AGENT_ID_CHARS)
    return text


def is_count(text: str) -> bool:
    """ASCII digits only (``"²".isdigit()`` is true in Python), and few enough to convert cheaply."""
    return 0 < len(text) <= MAX_COUNT_DIGITS and text.isascii() and text.isdigit()


ENGINE_KEYS = frozenset(setting.key for setting in SETTINGS if setting.key.startswith("engine."))
"""What TUNE may set: the engine's settings (every one applies to a running daemon)."""
MAX_TUNE_SETTINGS = len(ENGINE_KEYS)


def _settings(text: str) -> tuple[tuple[str, str], ...]:
    """TUNE's ``engine.<key>=<value>`` words: known engine keys, each once, values not empty (their types and ranges
    are the config's to check)."""
    words = text.split()
    if len(words) > MAX_TUNE_SETTINGS:
        raise _bad(f"TUNE takes at most {MAX_TUNE_SETTINGS} settings", max=MAX_TUNE_SETTINGS)
    pairs: list[tuple[str, str]] = []
    for word in words:
        key, equals, value = word.partition("=")
        if pairs and not equals and key not in ENGINE_KEYS:  # the rest of the value before it, cut at a space
            last = pairs[-1][0]
            raise _bad(f"{last}: a TUNE value is {VALUE_WORDS}; {word[:64]!r} follows it", key=last)
        if key not in ENGINE_KEYS:
            raise _bad(f"TUNE sets engine settings only, as engine.<key>=<value>; not {word[:64]!r}",
                       key=key[:64])
        if not equals or not value:
            raise _bad(f"usage: TUNE {key}=<value>", key=key)
        if any(key == seen for seen, _ in pairs):
            raise _bad(f"{key} given twice", key=key)
        pairs.append((key, value))
    return tuple(pairs)


def _status_offset(rest: str) -> int:
    """``STATUS agents <offset>``'s offset."""
    what, _, offset = rest.partition(" ")
    offset = offset.strip()
    if what.lower() != "agents" or not offset.isascii() or not offset.isdigit() or len(offset) > MAX_OFFSET_DIGITS:
        raise _bad("usage: STATUS [agents <offset>]", arguments=rest[:64])
    return int(offset)


RELOAD_TRIGGERS = ("benchmark",)
"""What RELOAD may name as its cause besides the default ``api``: ``appliance benchmark --apply``."""


def parse_line(line: str | bytes) -> Command:
    """Parse one request line (without or with its trailing newline); raise ApplianceError on bad input."""
    if isinstance(line, bytes):
        if len(line) > MAX_LINE_BYTES:
            raise _bad(f"line longer than {MAX_LINE_BYTES} bytes", max_line_bytes=MAX_LINE_BYTES)
        try:
            line = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise _bad("line is not valid UTF-8") from exc
    line = line.rstrip("\r\n")
    if "\x00" in line:
        raise _bad("line contains a NUL byte")
    head, _, rest = line.strip().partition(" ")
    name = head.upper()
    if not name:
        raise _bad("empty line")
    if name not in COMMANDS:
        raise ApplianceError("UNKNOWN_COMMAND", f"unknown command {head[:32]!r}; try HELP", {"command": head[:32]})
    rest = rest.strip()
    if name == "STATUS" and rest:
        return Command(name, offset=_status_offset(rest))
    if name in ("HELP", "STATUS", "LIST", "RESYNC"):
        if rest:
            raise _bad(f"{name} takes no arguments")
        return Command(name)
    if name == "RELOAD":
        if rest and rest.lower() not in RELOAD_TRIGGERS:
            raise _bad(f"usage: RELOAD [{'|'.join(RELOAD_TRIGGERS)}]", trigger=rest[:32])
        return Command(name, trigger=rest.lower() or "api")
    if name == "TUNE":
        return Command(name, settings=_settings(rest))
    if name == "UNREGISTER":
        if not rest or " " in rest:
            raise _bad("usage: UNREGISTER <agent>")
        return Command(name, agent=_agent(rest))
    if name == "REGISTER":
        agent, _, model = rest.partition(" ")
        model = model.strip()
        if not agent or not model:
            raise _bad("usage: REGISTER <agent> <model|gguf path>")
        return Command(name, agent=_agent(agent), model=model)
    # DECODE <agent> <n_tokens> [prompt]
    parts = rest.split(" ", 2)
    if len(parts) < 2:
        raise _bad("usage: DECODE <agent> <n_tokens> [prompt]")
    agent, count = parts[0], parts[1]
    if not is_count(count) or not 1 <= int(count) <= MAX_DECODE_TOKENS:
        raise _bad(f"n_tokens must be an integer in 1..{MAX_DECODE_TOKENS}", n_tokens=count[:32],
                   max=MAX_DECODE_TOKENS)
    prompt = parts[2] if len(parts) == 3 else ""
    return Command(name, agent=_agent(agent), n_tokens=int(count), prompt=prompt)


class LineProtocolError(Exception):
    """The peer sent a line that is not a valid command. ``error`` is its P4 error; when ``fatal`` (a line over
    :data:`MAX_LINE_BYTES`) the reader is in its error state and the connection must close after the ERR."""

    def __init__(self, error: ApplianceError, *, fatal: bool = False) -> None:
        super().__init__(str(error))
        self.error = error
        self.fatal = fatal


class LineReader:
    """Split a byte stream into request lines and parse each one.

    Blank lines are skipped. At end of stream (``receive_data(b"")``) a last line without its newline still
    counts (``nc -N`` sends one). A line may be at most :data:`MAX_LINE_BYTES` long, newline excluded: the
    reader refuses it as soon as that many bytes are buffered without a newline, without waiting for the rest.
    """

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._start = 0  # where the next line begins: consumed bytes are dropped in receive_data, not per line
        self._scanned = 0  # no newline before this offset
        self._eof = False
        self._error: LineProtocolError | None = None

    @property
    def buffered(self) -> int:
        """Bytes received and not yet returned as a line."""
        return len(self._buffer) - self._start

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer ``data``; ``b""`` signals end of stream. In the error state re-raises the fatal error."""
        if self._error is not None:
            raise self._error
        if self._eof:
            raise RuntimeError("receive_data() after end of stream")
        if not data:
            self._eof = True
            return
        if self._start:
            del self._buffer[: self._start]
            self._scanned -= self._start
            self._start = 0
        self._buffer += data

    def next_event(self) -> Command | Literal[Sentinel.NEED_DATA, Sentinel.CLOSED]:
        """The next command, :data:`NEED_DATA` or :data:`CLOSED`; raises :class:`LineProtocolError`."""
        if self._error is not None:
            raise self._error
        while True:
            raw = self._next_line()
            if raw is None:
                return NEED_DATA
            if raw is CLOSED:
                return CLOSED
            if raw.strip():
                break
        try:
            return parse_line(raw)
        except ApplianceError as exc:
            raise LineProtocolError(exc) from None

    def _next_line(self) -> bytes | Literal[Sentinel.CLOSED] | None:
        buffer = self._buffer
        start = self._start
        newline = buffer.find(b"\n", self._scanned, start + MAX_LINE_BYTES + 1)
        if newline >= 0:
            self._start = newline + 1
            self._scanned = newline + 1
            return bytes(buffer[start:newline])
        self._scanned = len(buffer)
        if len(buffer) - start > MAX_LINE_BYTES:
            error = _bad(f"line longer than {MAX_LINE_BYTES} bytes", max_line_bytes=MAX_LINE_BYTES)
            self._error = LineProtocolError(error, fatal=True)
            raise self._error
        if not self._eof:
            return None
        if start == len(buffer):
            return CLOSED
        self._start = len(buffer)
        self._scanned = len(buffer)
        return bytes(buffer[start:])


MARKERS = ("OK", "ERR", "BEGIN_RESPONSE", "END_RESPONSE")
"""What a reply line may begin with: a body line that would begin so is escaped."""
# a backslash; control characters but tab (C0, DEL, C1); the line and paragraph separators
_CONTROL = re.compile("[\\\\\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]")
_CONTROL_OR_QUOTE = re.compile('[\\\\"\x00-\x08\x0a-\x1f\x7f-\x9f\u2028\u2029]')
_NEEDS_QUOTES = re.compile('[\\s"=\\\\\x00-\x1f\x7f-\x9f]')
_ESCAPE = re.compile(r"\\(x[0-9A-Fa-f]{2}|u[0-9A-Fa-f]{4}|.)", re.DOTALL)
_NAMED_ESCAPES = {"\\": "\\\\", "\r": "\\r", "\n": "\\n", '"': '\\"'}
_FIELD = re.compile(r'([^\s=]+)=("(?:[^"\\]|\\.)*"|\S*)')


def _escape_char(match: re.Match[str]) -> str:
    char = match.group()
    named = _NAMED_ESCAPES.get(char)
    if named is not None:
        return named
    code = ord(char)
    if code < 0x100:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}"


def _unescape_char(match: re.Match[str]) -> str:
    escape = match.group(1)
    if escape == "r":
        return "\r"
    if escape == "n":
        return "\n"
    if len(escape) > 1:
        return chr(int(escape[1:], 16))
    return escape


def escape_body_line(line: str) -> str:
    r"""One body line as it goes on the wire (see the module docstring); a ``\n`` in it is escaped too."""
    text = _CONTROL.sub(_escape_char, line)
    if text.lstrip(" \t").startswith(MARKERS):
        return "\\" + text
    return text


def unescape(text: str) -> str:
    """The inverse of :func:`escape_body_line` and of a quoted value's escapes (quotes already removed)."""
    if "\\" not in text:
        return text
    return _ESCAPE.sub(_unescape_char, text)


def format_value(value: Any) -> str:
    """A value as it appears after ``key=``: bare when it needs no quotes, else quoted (module docstring)."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.3f}"
    if isinstance(value, Mapping):
        text = ",".join(f"{key}:{item}" for key, item in value.items())
    elif isinstance(value, set | frozenset):
        text = ",".join(sorted(str(item) for item in value))
    elif isinstance(value, list | tuple):
        text = ",".join(str(item) for item in value)
    else:
        text = str(value)
    if text and not _NEEDS_QUOTES.search(text):
        return text
    return '"' + _CONTROL_OR_QUOTE.sub(_escape_char, text) + '"'


def format_fields(fields: Mapping[str, Any]) -> str:
    return " ".join(f"{key}={format_value(value)}" for key, value in fields.items())


def parse_fields(text: str) -> dict[str, str]:
    """The ``key=value`` pairs of a header or ``ERR`` line's tail, values unquoted and unescaped (as text)."""
    fields: dict[str, str] = {}
    for match in _FIELD.finditer(text):
        key, value = match.group(1), match.group(2)
        if value.startswith('"'):
            value = unescape(value[1:-1])
        fields[key] = value
    return fields


def format_error(error: ApplianceError) -> str:
    """One ``ERR`` line (with newline) for a P4 error."""
    tail = format_fields(error.details) if error.details else format_fields({"message": error.message})
    return f"ERR {error.code} {tail}\n"


def format_reply(invoke: str, headers: Iterable[Mapping[str, Any]] = (), body: Iterable[str] = (),
                 **ids: Any) -> str:
    r"""An OK reply: schema line, ``invoke=`` line, header lines, then the body between markers; each text of
    ``body`` is one or more lines (split on ``\n``), each escaped with :func:`escape_body_line`."""
    lines = [f"OK schema={SCHEMA}", "OK " + format_fields({"invoke": invoke, **ids})]
    lines += ["OK " + format_fields(header) for header in headers]
    lines.append("BEGIN_RESPONSE")
    lines += [escape_body_line(line) for text in body for line in text.split("\n")]
    lines.append("END_RESPONSE")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Reply:
    """A reply read back (:func:`parse_reply`): ``error`` for an ``ERR`` line, else the OK ``fields`` of all
    header lines and the unescaped ``body`` (None when the reply had no body line)."""

    fields: dict[str, str]
    body: str | None = None
    error: ApplianceError | None = None


def parse_reply(text: str) -> Reply:
    """Read one whole reply (as :func:`format_reply` or :func:`format_error` wrote it); raise ValueError if it
    is neither an ``ERR`` line nor ``OK`` lines with a complete body."""
    lines = text.split("\n")
    first = lines[0]
    if first.startswith("ERR "):
        code, _, tail = first[4:].partition(" ")
        fields = parse_fields(tail)
        message = fields.get("message", "") if list(fields) == ["message"] else ""
        details: dict[str, Any] = {} if list(fields) == ["message"] else dict(fields)
        return Reply(fields, error=ApplianceError(code, message, details))
    fields = {}
    index = 0
    while index < len(lines) and lines[index].startswith("OK "):
        fields.update(parse_fields(lines[index][3:]))
        index += 1
    if index >= len(lines) or lines[index] != "BEGIN_RESPONSE":
        raise ValueError("reply has no BEGIN_RESPONSE line after its OK lines")
    try:
        end = lines.index("END_RESPONSE", index + 1)
    except ValueError:
        raise ValueError("reply has no END_RESPONSE line") from None
    body_lines = lines[index + 1:end]
    body = "\n".join(unescape(line) for line in body_lines) if body_lines else None
    return Reply(fields, body)


class ReplyReader:
    """The client's sans-IO reader: split a stream of replies (pipelined commands are answered in order) into
    :class:`Reply` objects. ``receive_data`` bytes as they come (``b""``: end of stream); ``next_event`` returns a
    :class:`Reply`, :data:`NEED_DATA` or :data:`CLOSED`, and raises ValueError for a stream that ends inside a
    reply or is not replies. A reply ends at its first line if that is ``ERR …``, else at ``END_RESPONSE``."""

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._lines: list[str] = []
        self._eof = False

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        if not data:
            self._eof = True
            return
        self._buffer += data

    def next_event(self) -> Reply | Literal[Sentinel.NEED_DATA, Sentinel.CLOSED]:
        while True:
            newline = self._buffer.find(b"\n")
            if newline < 0:
                break
            line = bytes(self._buffer[:newline]).decode("utf-8")
            del self._buffer[: newline + 1]
            self._lines.append(line)
            ends = line == "END_RESPONSE" or (len(self._lines) == 1 and line.startswith("ERR "))
            if ends:
                text = "\n".join(self._lines) + "\n"
                self._lines = []
                return parse_reply(text)
        if not self._eof:
            return NEED_DATA
        if self._buffer or self._lines:
            raise ValueError("the stream ended inside a reply")
        return CLOSED


def format_records(kind: str, records: Iterable[Mapping[str, Any]]) -> list[str]:
    """Body lines ``<kind> key=value …`` for STATUS and LIST."""
    return [f"{kind} {format_fields(record)}" for record in records]


def help_text() -> str:
    return format_reply("HELP", body=list(COMMANDS.values()))
