"""MAGN frames (SPEC P1, P2): a sans-IO encoder and an incremental parser, in the style of h11.

Wire format
-----------

A frame is a 10-byte header followed by ``length`` payload bytes:

=========  ==========  =====================================================================
field      encoding    value
=========  ==========  =====================================================================
magic      uint32 BE   0x4D474E54: the bytes are ASCII ``b"MGNT"`` although SPEC says "MAGN"
version    uint16 BE   1
length     uint32 BE   the number of payload bytes that follow
payload    bytes       standard padded base64 of the UTF-8 JSON text of one object
=========  ==========  =====================================================================

``max_frame_bytes`` bounds ``length`` (the base64 payload; the 10-byte header is not counted). Nothing here
touches a socket.

Errors
------

Errors follow h11: :class:`LocalProtocolError` means *we* tried to build or send something invalid,
:class:`RemoteProtocolError` means the *peer* sent something invalid; both carry ``.error``, an
:class:`~appliance.errors.ApplianceError` with a P4 code.

Fatal (``RemoteProtocolError.fatal``; the framing is lost, close the connection):

- ``BAD_MAGIC`` as soon as the buffered bytes can no longer start with the magic (one wrong byte is enough);
- ``UNSUPPORTED_VERSION`` once the 6 bytes of magic and version are in;
- ``FRAME_TOO_LARGE`` once the header is in (no payload byte is needed);
- ``BAD_PAYLOAD`` with ``details["reason"] == "truncated frame"`` when the stream ends inside a frame.

Recoverable (``fatal`` false): ``BAD_PAYLOAD`` for a frame with a valid header whose payload is not base64 of a
UTF-8 JSON object within the limits below (``details["stage"]`` says which step failed, ``details["reason"]``
why, and a broken limit is in the details under its name). The frame's bytes are consumed, the parser is back
in ``HEADER`` and the next :meth:`FrameParser.next_event` call goes on with the following frame.

Payload limits
--------------

The cost of ``json.loads`` and of checking its result grows with the number of JSON values, not only with the
frame's size, so before the JSON is parsed its structure is counted at C speed (:func:`count_json_items`):
at most :data:`MAX_JSON_ITEMS` of the characters ``[``, ``{`` and ``,`` outside strings (``max_json_items``).
While parsing, an integer may have at most :data:`MAX_JSON_INT_DIGITS` digits (``max_int_digits``: a longer one
is out of the 64-bit range anyway), and the payload may nest at most :data:`MAX_JSON_DEPTH` deep
(``max_depth``). NaN and Infinity (not JSON) are refused with the field that holds them (``number is not
finite``).

Parser states
-------------

:class:`FrameParser` is in one of the :class:`ParserState` states:

- ``HEADER``: waiting for a 10-byte header (the initial state);
- ``PAYLOAD``: the header was accepted, waiting for its payload;
- ``CLOSED``: end of stream was signalled with ``receive_data(b"")`` and every frame was returned;
- ``ERROR``: after a fatal error; all further calls re-raise it.
"""

from __future__ import annotations

import base64
import binascii
import enum
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from appliance.errors import ApplianceError
from appliance.protocol import jsoncodec
from appliance.protocol.events import CLOSED, NEED_DATA, Sentinel

MAGIC = 0x4D474E54
MAGIC_BYTES = MAGIC.to_bytes(4, "big")  # b"MGNT"
VERSION = 0x0001
SUPPORTED_VERSIONS: frozenset[int] = frozenset({VERSION})
HEADER = struct.Struct(">IHI")
DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
MAX_JSON_DEPTH = 64
"""Deepest nesting of objects/arrays accepted in a payload (the payload object itself is depth 1)."""
MAX_JSON_ITEMS = 16384
"""Most ``[``, ``{`` and ``,`` outside strings in one payload: 4,096 chat messages take about 12,300; checking a
payload at the limit takes some 20 ms of Python."""
MAX_JSON_INT_DIGITS = 20
"""Most digits of one JSON integer (2**64 - 1 has 20); ``json.loads`` alone would convert up to 4,300."""

_MAGIC_AND_VERSION_SIZE = 6  # the header's first two fields: enough to check the version
_MAX_VERSION = 0xFFFF  # uint16
_MAX_LENGTH = 0xFFFFFFFF  # uint32
_INT_MIN = -(2**63)
_INT_MAX = 2**64 - 1
_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_PIECE = 1 << 18
"""Long non-ASCII text is searched for surrogates this many characters at a time (about 2 ms each on a slow core),
so a thread checking a big prompt off the event loop holds the GIL no longer than that at a time."""


def is_valid_unicode(text: str) -> bool:
    """True when ``text`` holds no lone surrogate, so that it encodes to UTF-8. ASCII text is answered at once."""
    if text.isascii():
        return True
    for start in range(0, len(text), _SURROGATE_PIECE):
        if _SURROGATE.search(text, start, start + _SURROGATE_PIECE):
            return False
    return True


class ProtocolError(Exception):
    """Base of the two protocol errors: ``error`` is the P4 error, ``task_id`` its task when known."""

    def __init__(
        self,
        code: str,
        message: str = "",
        *,
        details: dict[str, Any] | None = None,
        task_id: str | None = None,
    ) -> None:
        self.error = ApplianceError(code, message, dict(details or {}))
        self.task_id = task_id
        super().__init__(str(self.error))

    @property
    def code(self) -> str:
        return self.error.code


class LocalProtocolError(ProtocolError):
    """We tried to build or send something that is not valid MAGN."""


class RemoteProtocolError(ProtocolError):
    """The peer sent something that is not valid MAGN; if ``fatal`` the connection must be closed."""

    def __init__(
        self,
        code: str,
        message: str = "",
        *,
        details: dict[str, Any] | None = None,
        task_id: str | None = None,
        fatal: bool = True,
    ) -> None:
        super().__init__(code, message, details=details, task_id=task_id)
        self.fatal = fatal


def _bad_json(path: str, reason: str, **limit: int) -> LocalProtocolError:
    """The ``BAD_PAYLOAD`` error for a value that is not strict JSON; ``path`` "" is the payload itself;
    ``limit`` the limit it broke, by name."""
    details = {"field": path or None, "reason": reason, **limit}
    return LocalProtocolError("BAD_PAYLOAD", f"{path or 'payload'}: {reason}", details=details)


def check_json(value: Any, path: str = "", depth: int = 1) -> None:
    """Raise :class:`LocalProtocolError` (``BAD_PAYLOAD``) unless ``value`` is a strict JSON value.

    Strict means: dicts with ``str`` keys, lists, ``str`` that is valid Unicode (no lone surrogates), ``bool``,
    ``None``, ints in [-2**63, 2**64 - 1], finite floats, at most :data:`MAX_JSON_DEPTH` deep. Such a value
    survives an encode/decode round trip unchanged. ``path`` names ``value`` in the error (``a.b[2]``).
    """
    if not _is_strict_json(value, depth):  # the paths of the error are made only for a value that fails
        _explain_json(value, path, depth)


def _is_strict_json(value: Any, depth: int) -> bool:
    """True when ``value`` of the plain JSON types (``dict``, ``list``, ``str``, ``int``, ``float``, ``bool``,
    ``None``; not their subclasses) passes :func:`check_json` at ``depth``; False for anything else, which
    :func:`_explain_json` then judges (a subclass may pass)."""
    kind = type(value)
    if kind is str:
        return is_valid_unicode(value)
    if kind is int:
        return _INT_MIN <= value <= _INT_MAX
    if kind is float:
        return math.isfinite(value)
    if value is None or kind is bool:
        return True
    if kind is dict:
        if depth > MAX_JSON_DEPTH:
            return False
        for key, item in value.items():
            if type(key) is not str or not is_valid_unicode(key):
                return False
            if not _is_strict_json(item, depth + 1):
                return False
        return True
    if kind is list:
        if depth > MAX_JSON_DEPTH:
            return False
        return all(_is_strict_json(item, depth + 1) for item in value)
    return False


def _explain_json(value: Any, path: str, depth: int) -> None:
    """:func:`check_json` the slow way: the error names the path of the first value that fails."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        if not is_valid_unicode(value):
            raise _bad_json(path, "string is not valid Unicode")
        return
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise _bad_json(path, "integer out of the 64-bit range", min=_INT_MIN, max=_INT_MAX)
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _bad_json(path, "number is not finite")
        return
    if isinstance(value, dict | list) and depth > MAX_JSON_DEPTH:
        raise _bad_json(path, f"nested deeper than {MAX_JSON_DEPTH}", max_depth=MAX_JSON_DEPTH)
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise _bad_json(path, f"object key {key!r} is not a string")
            _explain_json(key, path, depth)
            if path:
                _explain_json(item, f"{path}.{key}", depth + 1)
            else:
                _explain_json(item, key, depth + 1)
        return
    if isinstance(value, list):
        for index, item in enumerate(value):
            _explain_json(item, f"{path}[{index}]", depth + 1)
        return
    raise _bad_json(path, f"{type(value).__name__} is not a JSON type")


def _is_uint16(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= _MAX_VERSION


@dataclass(frozen=True)
class Frame:
    """One frame: a JSON object ``payload`` and the header's ``version``.

    Construction validates: ``payload`` must pass :func:`check_json` and be a dict, ``version`` must fit a
    uint16 (any uint16 may be *encoded*, so a peer's version check can be tested; the parser only yields
    frames whose version is in :data:`SUPPORTED_VERSIONS`). Raises :class:`LocalProtocolError`.
    """

    payload: dict[str, Any]
    version: int = VERSION

    def __post_init__(self) -> None:
        if not _is_uint16(self.version):
            raise LocalProtocolError(
                "UNSUPPORTED_VERSION",
                f"version {self.version!r} is not a uint16",
                details={"version": repr(self.version)},
            )
        if not isinstance(self.payload, dict):
            raise _bad_json("", "payload is not a JSON object")
        check_json(self.payload)

    def to_bytes(self, *, max_frame_bytes: int | None = None) -> bytes:
        """The frame on the wire; ``FRAME_TOO_LARGE`` if the base64 payload exceeds ``max_frame_bytes``,
        ``BAD_PAYLOAD`` if it holds more than :data:`MAX_JSON_ITEMS` values (a peer would refuse it)."""
        data = jsoncodec.dumps(self.payload)  # check_json passed: no NaN, so the standard library's meaning
        if len(data) > MAX_JSON_ITEMS and count_json_items(data.decode("utf-8")) > MAX_JSON_ITEMS:  # a peer refuses
            raise _bad_json("", f"holds more than {MAX_JSON_ITEMS} JSON values", max_json_items=MAX_JSON_ITEMS)
        body = base64.b64encode(data)
        limit = _MAX_LENGTH if max_frame_bytes is None else min(max_frame_bytes, _MAX_LENGTH)
        if len(body) > limit:
            raise LocalProtocolError(
                "FRAME_TOO_LARGE",
                f"payload of {len(body)} bytes is over {limit}",
                details={"length": len(body), "max_frame_bytes": limit},
            )
        return HEADER.pack(MAGIC, self.version, len(body)) + body


def encode_frame(payload: dict[str, Any], *, version: int = VERSION, max_frame_bytes: int | None = None) -> bytes:
    """Encode ``payload`` as one frame; raises :class:`LocalProtocolError` (see :class:`Frame`)."""
    return Frame(payload, version).to_bytes(max_frame_bytes=max_frame_bytes)


def looks_like_magn(prefix: bytes) -> bool:
    """True while ``prefix`` (the first bytes of a stream) can still be the start of a MAGN frame.

    An empty or partial prefix of :data:`MAGIC_BYTES` answers True: read more before choosing another protocol.
    """
    return bytes(prefix[:4]) == MAGIC_BYTES[: len(prefix)]


class ParserState(enum.Enum):
    """Where a :class:`FrameParser` is; see the module docstring."""

    HEADER = "HEADER"
    PAYLOAD = "PAYLOAD"
    CLOSED = "CLOSED"
    ERROR = "ERROR"


class FrameParser:
    """Incremental MAGN parser: feed bytes with :meth:`receive_data`, pull frames with :meth:`next_event`.

    See the module docstring for the states and which errors are fatal.
    """

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        if max_frame_bytes < 0:
            raise ValueError("max_frame_bytes must be >= 0")
        self.max_frame_bytes = max_frame_bytes
        self._buffer = bytearray()
        self._length: int | None = None  # payload length of the frame whose header was read
        self.last_length = 0  # payload length of the last frame returned (for debug logs)
        self._version = VERSION
        self._eof = False
        self._error: RemoteProtocolError | None = None

    @property
    def state(self) -> ParserState:
        if self._error is not None:
            return ParserState.ERROR
        if self._length is not None:
            return ParserState.PAYLOAD
        if self._eof and not self._buffer:
            return ParserState.CLOSED
        return ParserState.HEADER

    @property
    def trailing_data(self) -> bytes:
        """Bytes received but not yet consumed by a returned frame (after an error: from the bad frame on)."""
        return bytes(self._buffer)

    @property
    def buffered_bytes(self) -> int:
        """How many bytes are received and not yet consumed (``len(trailing_data)`` without the copy)."""
        return len(self._buffer)

    @property
    def pending_frame_bytes(self) -> int:
        """The size, header included, of the frame at the front of the buffer as its header announces it (0 when
        nothing is buffered; the bytes buffered while the header is incomplete). Parsing a complete frame costs
        time in proportion to it: a caller can run :meth:`next_event` off its event loop when it is large."""
        if self._length is not None:
            return HEADER.size + self._length
        if len(self._buffer) < HEADER.size:
            return len(self._buffer)
        (length,) = struct.unpack_from(">I", self._buffer, _MAGIC_AND_VERSION_SIZE)
        return HEADER.size + length

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer ``data``; ``b""`` signals end of stream. In the ERROR state re-raises the fatal error."""
        if self._error is not None:
            raise self._error
        if self._eof:
            raise RuntimeError("receive_data() after end of stream")
        if data:
            self._buffer += data
        else:
            self._eof = True

    def next_event(self) -> Frame | Literal[Sentinel.NEED_DATA, Sentinel.CLOSED]:
        """Return the next complete :class:`Frame`, :data:`NEED_DATA` or :data:`CLOSED`.

        Raises :class:`RemoteProtocolError`; after a fatal one every later call raises it again.
        """
        if self._error is not None:
            raise self._error
        try:
            return self._next_event()
        except RemoteProtocolError as exc:
            if exc.fatal:
                self._error = exc
            raise

    def _next_event(self) -> Frame | Literal[Sentinel.NEED_DATA, Sentinel.CLOSED]:
        if self._length is None:
            self._check_magic_and_version()
            if len(self._buffer) < HEADER.size:
                return self._starved()
            self._length = self._read_header()
        end = HEADER.size + self._length
        if len(self._buffer) < end:
            return self._starved()
        body = self._buffer[HEADER.size:end]  # one copy (a bytearray), then the frame leaves the buffer
        del self._buffer[:end]
        self.last_length = self._length
        self._length = None
        frame = _checked_frame(_decode_payload(body, jsoncodec.loads), self._version)
        if frame is not None:
            return frame
        # Refused: decoded again by the standard library alone, so the error is the one its hooks find first (an
        # integer of too many digits, which msgspec builds, before the range check that refused it).
        payload = _decode_payload(body, jsoncodec.stdlib_loads)
        try:
            return Frame(payload, self._version)
        except LocalProtocolError as exc:  # valid JSON outside our strict subset (depth, range, surrogates)
            details = dict(exc.error.details)
            field = details.pop("field", None)
            details.pop("reason", None)
            raise _remote_bad_payload("json", exc.error.message, field=field, **details) from None

    def _check_magic_and_version(self) -> None:
        """Refuse the buffered start of a header as soon as it cannot be a frame we accept."""
        if not looks_like_magn(self._buffer):
            raise RemoteProtocolError(
                "BAD_MAGIC",
                "stream does not start with the MAGN magic",
                details={"received": bytes(self._buffer[:4]).hex()},
            )
        if len(self._buffer) < _MAGIC_AND_VERSION_SIZE:
            return
        (version,) = struct.unpack_from(">H", self._buffer, 4)
        if version not in SUPPORTED_VERSIONS:
            raise RemoteProtocolError(
                "UNSUPPORTED_VERSION",
                f"version {version} is not supported",
                details={"version": version, "supported": sorted(SUPPORTED_VERSIONS)},
            )

    def _read_header(self) -> int:
        """Accept the buffered header (left in the buffer) and return its payload length."""
        _, self._version, length = HEADER.unpack_from(self._buffer)
        limit = self.max_frame_bytes
        if length > limit:
            raise RemoteProtocolError(
                "FRAME_TOO_LARGE",
                f"payload of {length} bytes is over {limit}",
                details={"length": length, "max_frame_bytes": limit},
            )
        return length

    def _starved(self) -> Literal[Sentinel.NEED_DATA, Sentinel.CLOSED]:
        """What to answer when the buffer holds no complete frame."""
        if not self._eof:
            return NEED_DATA
        if not self._buffer:
            return CLOSED
        raise RemoteProtocolError(
            "BAD_PAYLOAD",
            "stream ended inside a frame",
            details={"reason": "truncated frame", "buffered": len(self._buffer)},
        )


def count_json_items(text: str, marks: int | None = None) -> int:
    """How many ``[``, ``{`` and ``,`` JSON ``text`` holds outside its strings, counted at C speed, as far as
    :data:`MAX_JSON_ITEMS` needs: within it, those inside strings may be counted too; past it, the count may stop
    at a number known to be past it. So the answer is past the limit exactly when the structure is.

    For valid JSON this bounds the values ``json.loads`` would build (each container with k values has k - 1
    commas), and for invalid JSON the values it builds before it fails, so it may be called on any text.
    ``marks``: those characters counted already, strings included (:func:`_b64decode` counts them piece by piece).
    """
    if len(text) <= MAX_JSON_ITEMS:
        return len(text)
    count = _marks(text) if marks is None else marks
    if count <= MAX_JSON_ITEMS:
        return count  # brackets and commas inside strings counted too: still within the limit
    plain = text
    if "\\" in plain:
        plain = plain.replace("\\\\", "").replace('\\"', "")  # escaped backslashes and quotes end no string
    strings = plain.count('"') // 2
    if strings > 2 * MAX_JSON_ITEMS + 1:  # (+ 1: a lone string is JSON too)
        return (strings + 1) // 2  # a container of k values holds at most 2k strings (keys included), k - 1 commas
    inside = "".join(plain.split('"')[1::2])
    return count - inside.count("[") - inside.count("{") - inside.count(",")


class _IntegerTooLong(ValueError):
    """Raised by :func:`_parse_int` inside ``json.loads``."""


def _parse_int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_JSON_INT_DIGITS:
        raise _IntegerTooLong(digits)
    return int(digits)


_BASE64_CHUNK = 1 << 18
"""Large payloads are base64-decoded in pieces of this many characters (a multiple of 4), about 1.5 ms each on a
slow core: a thread that parses a big frame off the event loop holds the GIL no longer than that at a time, so
the loop (which needs the GIL back after every system call) is never kept waiting long."""


def _marks(text: str | bytes) -> int:
    """The ``[``, ``{`` and ``,`` in ``text``, strings included (the first count of :func:`count_json_items`)."""
    if isinstance(text, str):
        return text.count("[") + text.count("{") + text.count(",")
    return text.count(b"[") + text.count(b"{") + text.count(b",")


def _b64decode(body: bytes | bytearray) -> tuple[bytes, int]:
    """Strict base64 (``b64decode(validate=True)``), decoded :data:`_BASE64_CHUNK` characters at a time, and the
    :func:`_marks` of what it decodes to, counted piece by piece (in UTF-8 those bytes are never part of another
    character, so the count is the decoded text's)."""
    if len(body) <= _BASE64_CHUNK:
        raw = binascii.a2b_base64(body, strict_mode=True)
        return raw, _marks(raw)
    view = memoryview(body)
    pieces = []
    marks = 0
    for start in range(0, len(body), _BASE64_CHUNK):
        piece = view[start:start + _BASE64_CHUNK]
        if len(piece) == _BASE64_CHUNK and start + _BASE64_CHUNK < len(body) and piece[-1] == ord("="):
            raise binascii.Error("padding before the end of the payload")
        decoded = binascii.a2b_base64(piece, strict_mode=True)
        marks += _marks(decoded)
        pieces.append(decoded)
    return b"".join(pieces), marks


def _checked_frame(payload: dict[str, Any], version: int) -> Frame | None:
    """The frame of a decoded ``payload``, or None when it is outside the strict subset :class:`Frame` checks."""
    try:
        return Frame(payload, version)
    except LocalProtocolError:
        return None


def _decode_payload(body: bytes | bytearray, loads: Callable[..., Any]) -> dict[str, Any]:
    """base64 -> UTF-8 -> JSON object (with ``loads``: :func:`jsoncodec.loads` or :func:`jsoncodec.stdlib_loads`),
    or a recoverable ``BAD_PAYLOAD`` naming the failing step (and the limit)."""
    try:
        raw, marks = _b64decode(body)
    except (binascii.Error, ValueError):
        raise _remote_bad_payload("base64", "payload is not valid base64") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _remote_bad_payload("utf-8", "payload is not UTF-8") from None
    if count_json_items(text, marks) > MAX_JSON_ITEMS:
        raise _remote_bad_payload("json", f"payload holds more than {MAX_JSON_ITEMS} JSON values",
                                  max_json_items=MAX_JSON_ITEMS)
    try:
        payload = loads(text, parse_int=_parse_int)  # NaN/Infinity load as floats; Frame() refuses them
    except _IntegerTooLong:
        raise _remote_bad_payload("json", f"integer of more than {MAX_JSON_INT_DIGITS} digits",
                                  max_int_digits=MAX_JSON_INT_DIGITS) from None
    except RecursionError:
        raise _remote_bad_payload("json", f"nested deeper than {MAX_JSON_DEPTH}", max_depth=MAX_JSON_DEPTH) from None
    except ValueError:
        raise _remote_bad_payload("json", "payload is not JSON") from None
    if not isinstance(payload, dict):
        raise _remote_bad_payload("json", "payload is not a JSON object")
    return payload


def _remote_bad_payload(stage: str, message: str, field: str | None = None, **limit: Any) -> RemoteProtocolError:
    """The recoverable ``BAD_PAYLOAD`` of a frame whose header was fine; ``stage``: base64, utf-8 or json;
    ``limit``: the limit it broke, by name."""
    details = {"stage": stage, "field": field, "reason": message, **limit}
    return RemoteProtocolError("BAD_PAYLOAD", message, details=details, fatal=False)
