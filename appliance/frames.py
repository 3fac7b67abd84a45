"""MAGN frames (SPEC P1, P2): a sans-IO encoder and an incremental parser, in the style of h11.

Wire format of one frame::

    magic   uint32 BE  0x4D474E54 ("MAGN")
    version uint16 BE  0x0001
    length  uint32 BE  number of payload bytes that follow
    payload            base64 (standard alphabet, padded) of the UTF-8 JSON text of one object

``max_frame_bytes`` bounds ``length``, i.e. the base64 payload, not counting the 10-byte header.

No sockets here: feed received bytes to :class:`FrameParser` and send what :func:`encode_frame` returns.

Errors follow h11: :class:`LocalProtocolError` means *we* tried to build or send something invalid,
:class:`RemoteProtocolError` means the *peer* sent something invalid. Both carry ``.error``, an
:class:`~appliance.errors.ApplianceError` whose code comes from the P4 table.

Parser states and recovery rules:

* ``HEADER`` -- waiting for (the rest of) a 10-byte header; the initial state.
* ``PAYLOAD`` -- a valid header was read; waiting for ``length`` payload bytes.
* ``CLOSED`` -- end of stream was signalled (``receive_data(b"")``) and every complete frame was returned.
* ``ERROR`` -- a fatal error was raised; the parser refuses all further data and re-raises that error.

Fatal (the framing is lost, so the connection must be closed; ``RemoteProtocolError.fatal`` is true):
``BAD_MAGIC`` (raised as soon as the buffered prefix can no longer be ``b"MAGN"``, even after one byte),
``UNSUPPORTED_VERSION`` (raised once the 6 bytes of magic and version are buffered),
``FRAME_TOO_LARGE`` (raised once the full header is buffered, before any payload byte is needed), and a
stream that ends in the middle of a frame (``BAD_PAYLOAD``, ``details["reason"] == "truncated frame"``).

Recoverable (``fatal`` is false): ``BAD_PAYLOAD`` for a frame whose header was valid but whose payload is not
base64 of a UTF-8 JSON object. The frame's bytes are consumed, the parser returns to ``HEADER`` and the next
call to :meth:`FrameParser.next_event` continues with the following frame.
"""

from __future__ import annotations

import base64
import binascii
import enum
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Literal

from appliance.errors import ApplianceError

__all__ = [
    "CLOSED", "DEFAULT_MAX_FRAME_BYTES", "HEADER", "MAGIC", "MAGIC_BYTES", "MAX_JSON_DEPTH", "NEED_DATA",
    "SUPPORTED_VERSIONS", "VERSION", "Frame", "FrameParser", "LocalProtocolError", "ParserState",
    "ProtocolError", "RemoteProtocolError", "Sentinel", "check_json", "encode_frame", "looks_like_magn",
]

MAGIC = 0x4D474E54
MAGIC_BYTES = b"MAGN"
VERSION = 0x0001
SUPPORTED_VERSIONS: frozenset[int] = frozenset({VERSION})
HEADER = struct.Struct(">IHI")
DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024
MAX_JSON_DEPTH = 64
"""Deepest nesting of objects/arrays accepted in a payload (the payload object itself is depth 1)."""

_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1


class ProtocolError(Exception):
    """Base of the two protocol errors; never raised itself.

    ``error`` is the P4 error to report, ``task_id`` the task it belongs to when known (for the ERROR reply).
    """

    def __init__(self, code: str, message: str = "", *, details: dict[str, Any] | None = None,
                 task_id: str | None = None) -> None:
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

    def __init__(self, code: str, message: str = "", *, details: dict[str, Any] | None = None,
                 task_id: str | None = None, fatal: bool = True) -> None:
        super().__init__(code, message, details=details, task_id=task_id)
        self.fatal = fatal


class Sentinel(enum.Enum):
    """Non-frame results of :meth:`FrameParser.next_event`."""

    NEED_DATA = "NEED_DATA"
    CLOSED = "CLOSED"

    def __repr__(self) -> str:
        return self.value


NEED_DATA = Sentinel.NEED_DATA
"""No complete frame is buffered: call ``receive_data`` with more bytes."""
CLOSED = Sentinel.CLOSED
"""End of stream was signalled and no bytes are left over."""


def _bad(path: str, reason: str) -> LocalProtocolError:
    return LocalProtocolError("BAD_PAYLOAD", f"{path or 'payload'}: {reason}",
                              details={"field": path or None, "reason": reason})


def check_json(value: Any, path: str = "", depth: int = 1) -> None:
    """Raise :class:`LocalProtocolError` (``BAD_PAYLOAD``) unless ``value`` is a strict JSON value.

    Strict means: dicts with ``str`` keys, lists, ``str`` that is valid Unicode (no lone surrogates),
    ``bool``, ``None``, ints in [-2**63, 2**64 - 1], finite floats, at most :data:`MAX_JSON_DEPTH` deep.
    Such a value survives an encode/decode round trip unchanged. ``path`` names ``value`` in the error.
    """
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise _bad(path, "string is not valid Unicode") from None
        return
    if isinstance(value, int):
        if not _INT_MIN <= value <= _INT_MAX:
            raise _bad(path, "integer out of the 64-bit range")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _bad(path, "number is not finite")
        return
    if isinstance(value, dict | list) and depth > MAX_JSON_DEPTH:
        raise _bad(path, f"nested deeper than {MAX_JSON_DEPTH}")
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise _bad(path, f"object key {key!r} is not a string")
            check_json(key, path, depth)
            check_json(item, f"{path}.{key}" if path else key, depth + 1)
        return
    if isinstance(value, list):
        for index, item in enumerate(value):
            check_json(item, f"{path}[{index}]", depth + 1)
        return
    raise _bad(path, f"{type(value).__name__} is not a JSON type")


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
        if not isinstance(self.version, int) or isinstance(self.version, bool) or not 0 <= self.version <= 0xFFFF:
            raise LocalProtocolError("UNSUPPORTED_VERSION", f"version {self.version!r} is not a uint16",
                                     details={"version": repr(self.version)})
        if not isinstance(self.payload, dict):
            raise _bad("", "payload is not a JSON object")
        check_json(self.payload)

    def to_bytes(self, *, max_frame_bytes: int | None = None) -> bytes:
        """The frame on the wire; ``FRAME_TOO_LARGE`` if the base64 payload exceeds ``max_frame_bytes``."""
        text = json.dumps(self.payload, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        body = base64.b64encode(text.encode("utf-8"))
        limit = 0xFFFFFFFF if max_frame_bytes is None else min(max_frame_bytes, 0xFFFFFFFF)
        if len(body) > limit:
            raise LocalProtocolError("FRAME_TOO_LARGE", f"payload of {len(body)} bytes is over {limit}",
                                     details={"length": len(body), "max_frame_bytes": limit})
        return HEADER.pack(MAGIC, self.version, len(body)) + body


def encode_frame(payload: dict[str, Any], *, version: int = VERSION, max_frame_bytes: int | None = None) -> bytes:
    """Encode ``payload`` as one frame; raises :class:`LocalProtocolError` (see :class:`Frame`)."""
    return Frame(payload, version).to_bytes(max_frame_bytes=max_frame_bytes)


def looks_like_magn(prefix: bytes) -> bool:
    """True while ``prefix`` (the first bytes of a stream) can still be the start of a MAGN frame.

    An empty or partial prefix of ``b"MAGN"`` answers True: read more before choosing another protocol.
    """
    return bytes(prefix[:4]) == MAGIC_BYTES[: len(prefix)]


class ParserState(enum.Enum):
    HEADER = "HEADER"
    PAYLOAD = "PAYLOAD"
    CLOSED = "CLOSED"
    ERROR = "ERROR"


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


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
        self._version = VERSION
        self._eof = False
        self._error: RemoteProtocolError | None = None

    @property
    def state(self) -> ParserState:
        if self._error is not None:
            return ParserState.ERROR
        if self._length is not None:
            return ParserState.PAYLOAD
        return ParserState.CLOSED if self._eof and not self._buffer else ParserState.HEADER

    @property
    def trailing_data(self) -> bytes:
        """Bytes received but not yet consumed by a returned frame (after an error: from the bad frame on)."""
        return bytes(self._buffer)

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
            return self._next()
        except RemoteProtocolError as exc:
            if exc.fatal:
                self._error = exc
            raise

    def _next(self) -> Frame | Literal[Sentinel.NEED_DATA, Sentinel.CLOSED]:
        buf = self._buffer
        if self._length is None:
            if not looks_like_magn(buf):
                raise RemoteProtocolError("BAD_MAGIC", "stream does not start with MAGN",
                                          details={"received": bytes(buf[:4]).hex()})
            if len(buf) >= 6:
                (version,) = struct.unpack_from(">H", buf, 4)
                if version not in SUPPORTED_VERSIONS:
                    raise RemoteProtocolError("UNSUPPORTED_VERSION", f"version {version} is not supported",
                                              details={"version": version,
                                                       "supported": sorted(SUPPORTED_VERSIONS)})
            if len(buf) < HEADER.size:
                return self._starved()
            _, self._version, length = HEADER.unpack_from(buf)
            if length > self.max_frame_bytes:
                raise RemoteProtocolError("FRAME_TOO_LARGE", f"payload of {length} bytes is over "
                                          f"{self.max_frame_bytes}",
                                          details={"length": length, "max_frame_bytes": self.max_frame_bytes})
            self._length = length
        end = HEADER.size + self._length
        if len(buf) < end:
            return self._starved()
        body = bytes(buf[HEADER.size:end])
        del buf[:end]
        self._length = None
        payload = _decode_payload(body)
        try:
            return Frame(payload, self._version)
        except LocalProtocolError as exc:  # valid JSON outside our strict subset (depth, range, surrogates)
            raise _remote_bad("json", exc.error.message, field=exc.error.details.get("field")) from None

    def _starved(self) -> Literal[Sentinel.NEED_DATA, Sentinel.CLOSED]:
        if not self._eof:
            return NEED_DATA
        if not self._buffer:
            return CLOSED
        raise RemoteProtocolError("BAD_PAYLOAD", "stream ended inside a frame",
                                  details={"reason": "truncated frame", "buffered": len(self._buffer)})


def _decode_payload(body: bytes) -> dict[str, Any]:
    """base64 -> UTF-8 -> JSON object, or a recoverable ``BAD_PAYLOAD`` naming the failing step."""
    try:
        raw = base64.b64decode(body, validate=True)
    except (binascii.Error, ValueError):
        raise _remote_bad("base64", "payload is not valid base64") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise _remote_bad("utf-8", "payload is not UTF-8") from None
    try:
        payload = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        raise _remote_bad("json", "payload is not JSON") from None
    if not isinstance(payload, dict):
        raise _remote_bad("json", "payload is not a JSON object")
    return payload


def _remote_bad(stage: str, message: str, field: str | None = None) -> RemoteProtocolError:
    return RemoteProtocolError("BAD_PAYLOAD", message, details={"stage": stage, "field": field}, fatal=False)
