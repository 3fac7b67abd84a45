"""The line protocol (SPEC L6, schema ``lmx-daemon/1``): pure parsing and formatting, no sockets.

A request is one line. :class:`LineReader` is the sans-IO reader (h11 style): ``receive_data`` bytes as they
come, ``next_event`` returns each :class:`Command`, :data:`NEED_DATA` or :data:`CLOSED`, and raises
:class:`LineProtocolError` for a bad line (not fatal: the next line is read as usual) or a line longer than
:data:`MAX_LINE_BYTES` (fatal: the framing is lost, answer and close).

A reply is either one ``ERR`` line, or ``OK`` header lines followed by a body between ``BEGIN_RESPONSE`` and
``END_RESPONSE``; so a client reads until it sees ``ERR …`` or ``END_RESPONSE``. ``ERR`` lines carry the P4
code, then the error's details as ``key=value``; an error without details carries its message as
``message="…"``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from appliance.errors import ApplianceError
from appliance.protocol.events import CLOSED, NEED_DATA, Sentinel

SCHEMA = "lmx-daemon/1"
MAX_LINE_BYTES = 64 * 1024
MAX_DECODE_TOKENS = 8192
MAX_COUNT_DIGITS = len(str(MAX_DECODE_TOKENS))
AGENT_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")

COMMANDS: dict[str, str] = {
    "HELP": "HELP                               this text",
    "STATUS": "STATUS                             device, ledger, models and agents",
    "LIST": "LIST                               configured models and their state",
    "REGISTER": "REGISTER <agent> <model|gguf path>  admit a model (ledger) and give the agent a slot",
    "UNREGISTER": "UNREGISTER <agent>                 free the agent's slot (and the model if unused)",
    "DECODE": "DECODE <agent> <n_tokens> [prompt]  generate; an empty prompt continues the conversation",
    "RESYNC": "RESYNC                             re-read the device and re-base the ledger cap",
}


@dataclass(frozen=True)
class Command:
    """One parsed request line."""

    name: str
    agent: str | None = None
    model: str | None = None
    n_tokens: int | None = None
    prompt: str = ""


def _bad(message: str, **details: Any) -> ApplianceError:
    return ApplianceError("BAD_REQUEST", message, details)


def _agent(text: str) -> str:
    if not AGENT_ID.fullmatch(text):
        raise _bad("agent id must be 1-64 of [A-Za-z0-9_.:-], starting with a letter or digit", agent=text)
    return text


def is_count(text: str) -> bool:
    """ASCII digits only (``"²".isdigit()`` is true in Python), and few enough to convert cheaply."""
    return 0 < len(text) <= MAX_COUNT_DIGITS and text.isascii() and text.isdigit()


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
    if name in ("HELP", "STATUS", "LIST", "RESYNC"):
        if rest:
            raise _bad(f"{name} takes no arguments")
        return Command(name)
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


def format_value(value: Any) -> str:
    """A value as it appears after ``key=``: bare when it has no spaces or quotes, else quoted."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:.3f}"
    text = str(value)
    if text and not re.search(r'[\s"=]', text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def format_fields(fields: Mapping[str, Any]) -> str:
    return " ".join(f"{key}={format_value(value)}" for key, value in fields.items())


def format_error(error: ApplianceError) -> str:
    """One ``ERR`` line (with newline) for a P4 error."""
    tail = format_fields(error.details) if error.details else format_fields({"message": error.message})
    return f"ERR {error.code} {tail}\n"


def format_reply(invoke: str, headers: Iterable[Mapping[str, Any]] = (), body: Iterable[str] = (),
                 **ids: Any) -> str:
    """An OK reply: schema line, ``invoke=`` line, header lines, then the body between markers."""
    lines = [f"OK schema={SCHEMA}", "OK " + format_fields({"invoke": invoke, **ids})]
    lines += ["OK " + format_fields(header) for header in headers]
    lines.append("BEGIN_RESPONSE")
    lines += [line for text in body for line in text.split("\n")]
    lines.append("END_RESPONSE")
    return "\n".join(lines) + "\n"


def format_records(kind: str, records: Iterable[Mapping[str, Any]]) -> list[str]:
    """Body lines ``<kind> key=value …`` for STATUS and LIST."""
    return [f"{kind} {format_fields(record)}" for record in records]


def help_text() -> str:
    return format_reply("HELP", body=list(COMMANDS.values()))
