"""MAGN messages (SPEC P3): frozen dataclasses, one per JSON ``type``, each field declaring its own check.

Construction validates (:class:`~appliance.protocol.frames.LocalProtocolError`, ``BAD_PAYLOAD``, ``details = {"field",
"reason"}``) and normalises (lists to tuples, dicts to records, ints to floats), so ``parse_message(m.to_payload())
== m``. :func:`parse_message` refuses unknown types and missing, unknown or invalid fields with a non-fatal
:class:`~appliance.protocol.frames.RemoteProtocolError` (the framing is intact, the connection can go on).

Tasks: the client picks a ``task_id`` for each TASK_START, INFER_REQUEST and CANCEL; many may be in flight at once.
TASK_START is answered by its echo with ``status``; INFER_REQUEST by any STREAM_TOKEN / HEARTBEAT and then one
TASK_COMPLETE or ERROR, all with its ``task_id``. CANCEL ends that task with ERROR ``CANCELLED`` (ignored for
unknown or finished tasks). ERROR with a null ``task_id`` concerns the connection. PROTOCOL_INFO without fields
asks; the reply PROTOCOL_INFO carries them all.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, NoReturn

from appliance.errors import TABLE, ApplianceError
from appliance.protocol.frames import VERSION, LocalProtocolError, RemoteProtocolError, check_json, encode_frame

SCHEMA = "magn/1"
MAX_ID_CHARS, MAX_TOKENS_LIMIT, MAX_STOP_STRINGS = 256, 131072, 16
ROLES = ("system", "user", "assistant", "tool")
STOP_REASONS = ("stop", "length", "tool_call")
_SURROGATE = re.compile("[\ud800-\udfff]")
Check = Callable[[Any, str], Any]  # (value, field name) -> normalised value, or _fail


def _fail(name: str, reason: str) -> NoReturn:
    raise LocalProtocolError("BAD_PAYLOAD", f"{name}: {reason}", details={"field": name, "reason": reason})


def _f(check: Check, default: Any = MISSING) -> Any:
    """A dataclass field checked by ``check``; None skips the check when None is also the default."""
    meta = {"check": check, "nullable": default is None}
    return field(default_factory=dict, metadata=meta) if default == {} else field(default=default, metadata=meta)


def _rule(ok: Callable[[Any], bool], reason: str, convert: Callable[[Any, str], Any] = lambda v, n: v) -> Check:
    """A check that fails with ``reason`` unless ``ok(value)``, and returns ``convert(value, name)``."""
    def check(value: Any, name: str) -> Any:
        if not ok(value):
            _fail(name, reason)
        return convert(value, name)
    return check


def _is_id(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS and not _SURROGATE.search(value)


def _num(lo: float, hi: float, *, integer: bool = False, open_lo: bool = False) -> Check:
    def ok(v: Any) -> bool:
        number = isinstance(v, int) and not isinstance(v, bool) and (integer or abs(v) <= 2**53) or (
            not integer and isinstance(v, float) and math.isfinite(v))
        return number and (lo < v if open_lo else lo <= v) and v <= hi
    kind, bracket = ("an integer", "[") if integer else ("a number", "(" if open_lo else "[")
    return _rule(ok, f"must be {kind} in {bracket}{lo}, {hi}]", lambda v, n: int(v) if integer else float(v))


def _seq(item: Check, max_len: int, *, non_empty: bool = False) -> Check:
    return _rule(lambda v: isinstance(v, list | tuple) and int(non_empty) <= len(v) <= max_len,
                 f"must be an array of {int(non_empty)} to {max_len} entries",
                 lambda v, n: tuple(item(x, f"{n}[{i}]") for i, x in enumerate(v)))


def _json(*kinds: type) -> Check:
    return _rule(lambda v: isinstance(v, kinds), "must be a JSON " + " or ".join(
        "object" if k is dict else "array" for k in kinds), lambda v, n: check_json(v, n) or v)


def _record(cls: Any) -> Check:
    return _rule(lambda v: isinstance(v, cls | dict), "must be a JSON object",
                 lambda v, n: v if isinstance(v, cls) else _build(cls, v, n))


_text = _rule(lambda v: isinstance(v, str) and not _SURROGATE.search(v), "must be a string of valid Unicode")
_ident = _rule(_is_id, f"must be a string of 1 to {MAX_ID_CHARS} valid characters")
_bool = _rule(lambda v: isinstance(v, bool), "must be a boolean")
_COUNT, _U16, _U32 = (_num(0, hi, integer=True) for hi in (2**31 - 1, 0xFFFF, 0xFFFFFFFF))
_timings = _rule(lambda v: isinstance(v, dict), "must be a JSON object of numbers",
                 lambda v, n: {k: _num(0.0, math.inf)(x, f"{n}.{k}") for k, x in _json(dict)(v, n).items()})


def _build(cls: Any, data: dict[str, Any], name: str) -> Any:
    """``cls(**data)`` for a payload dict, with missing/unknown keys and inner errors named under ``name``."""
    prefix = f"{name}." if name else ""
    known = {f.name: f for f in fields(cls)}
    unknown = [k for k in data if k not in known]
    missing = [k for k, f in known.items() if k not in data and f.default is MISSING and f.default_factory is MISSING]
    if unknown or missing:
        _fail(f"{prefix}{(unknown or missing)[0]}", "unknown field" if unknown else "missing")
    try:
        return cls(**data)
    except LocalProtocolError as exc:
        _fail(f"{prefix}{exc.error.details['field']}", exc.error.details["reason"])


def _dump(value: Any) -> Any:
    if isinstance(value, _Record):
        return {f.name: _dump(getattr(value, f.name)) for f in fields(value)}  # type: ignore[arg-type]
    if isinstance(value, tuple | list):
        return [_dump(item) for item in value]
    return dict(value) if isinstance(value, dict) else value


class _Record:
    """Base of the frozen dataclasses here: runs each field's check, then :meth:`_validate`."""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if not (value is None and f.metadata["nullable"]):
                object.__setattr__(self, f.name, f.metadata["check"](value, f.name))
        self._validate()

    def _validate(self) -> None:
        """Rules across fields; subclasses override."""


@dataclass(frozen=True)
class ChatMessage(_Record):
    role: str = _f(_rule(lambda v: v in ROLES, f"must be one of {list(ROLES)}"))
    content: str = _f(_text)


@dataclass(frozen=True)
class Usage(_Record):
    prompt_tokens: int = _f(_COUNT)
    completion_tokens: int = _f(_COUNT)


@dataclass(frozen=True)
class ToolCall(_Record):
    name: str = _f(_ident)
    arguments: dict[str, Any] = _f(_json(dict), {})


@dataclass(frozen=True)
class ErrorBody(_Record):
    """The P4 shape; ``retryable`` is always the table's value for ``code``, an empty message its summary."""
    code: str = _f(_rule(lambda v: isinstance(v, str) and v in TABLE, "must be a code of the P4 error table"))
    message: str = _f(_text, "")
    retryable: bool = _f(_bool, False)
    details: dict[str, Any] = _f(_json(dict), {})

    def _validate(self) -> None:
        object.__setattr__(self, "message", self.message or TABLE[self.code].summary)
        object.__setattr__(self, "retryable", TABLE[self.code].retryable)

    def exception(self) -> ApplianceError:
        return ApplianceError(self.code, self.message, dict(self.details))


class _Message(_Record):
    TYPE: ClassVar[str]  # the payload's "type"

    def to_payload(self) -> dict[str, Any]:
        """The JSON object to send: ``{"type": TYPE, <every field>}`` (None as null, tuples as lists)."""
        return {"type": self.TYPE, **_dump(self)}


@dataclass(frozen=True)
class TaskStart(_Message):
    """Open the agent session ``session_id`` on ``model``; the server's echo sets ``status`` (e.g. "started")."""
    TYPE: ClassVar[str] = "TASK_START"
    task_id: str = _f(_ident)
    session_id: str = _f(_ident)
    model: str = _f(_ident)
    tools: list[Any] | dict[str, Any] | None = _f(_json(list, dict), None)
    status: str | None = _f(_ident, None)


@dataclass(frozen=True)
class InferRequest(_Message):
    """Generate: exactly one of ``prompt``/``messages``; ``session_id`` (an agent's conversation) or ``model``."""
    TYPE: ClassVar[str] = "INFER_REQUEST"
    task_id: str = _f(_ident)
    model: str | None = _f(_ident, None)
    session_id: str | None = _f(_ident, None)
    prompt: str | None = _f(_text, None)
    messages: tuple[ChatMessage, ...] | None = _f(_seq(_record(ChatMessage), 4096, non_empty=True), None)
    max_tokens: int = _f(_num(1, MAX_TOKENS_LIMIT, integer=True), 256)
    temperature: float = _f(_num(0.0, 2.0), 0.8)
    top_p: float = _f(_num(0.0, 1.0, open_lo=True), 0.95)
    stop: tuple[str, ...] = _f(_seq(_ident, MAX_STOP_STRINGS), ())
    stream: bool = _f(_bool, False)

    def _validate(self) -> None:
        if self.model is None and self.session_id is None:
            _fail("model", "one of model or session_id is required")
        if (self.prompt is None) == (self.messages is None):
            _fail("prompt", "exactly one of prompt or messages is required")


@dataclass(frozen=True)
class StreamToken(_Message):
    """One generated token of a streaming task; ``timestamp`` in seconds since the epoch."""
    TYPE: ClassVar[str] = "STREAM_TOKEN"
    task_id: str = _f(_ident)
    text: str = _f(_text)
    token_id: int = _f(_COUNT)
    timestamp: float = _f(_num(0.0, math.inf))
    logprob: float | None = _f(_num(-math.inf, 0.0), None)


@dataclass(frozen=True)
class Heartbeat(_Message):
    """The task is alive but produced no token for a while."""
    TYPE: ClassVar[str] = "HEARTBEAT"
    task_id: str = _f(_ident)
    timestamp: float | None = _f(_num(0.0, math.inf), None)


@dataclass(frozen=True)
class TaskComplete(_Message):
    """A result; ``timings``: name -> number >= 0 (``ttft_ms``...), ``stats``: free JSON (plan, threads...)."""
    TYPE: ClassVar[str] = "TASK_COMPLETE"
    task_id: str = _f(_ident)
    text: str = _f(_text)
    usage: Usage = _f(_record(Usage))
    stop_reason: str = _f(_rule(lambda v: v in STOP_REASONS, f"must be one of {list(STOP_REASONS)}"))
    timings: dict[str, float] = _f(_timings, {})
    tool_call: ToolCall | None = _f(_record(ToolCall), None)
    stats: dict[str, Any] = _f(_json(dict), {})


@dataclass(frozen=True)
class Cancel(_Message):
    """Stop the task ``task_id``."""
    TYPE: ClassVar[str] = "CANCEL"
    task_id: str = _f(_ident)


@dataclass(frozen=True)
class ProtocolInfoRequest(_Message):
    """PROTOCOL_INFO with no fields: ask the server what it speaks."""
    TYPE: ClassVar[str] = "PROTOCOL_INFO"


@dataclass(frozen=True)
class ProtocolInfo(_Message):
    """The server's PROTOCOL_INFO reply."""
    TYPE: ClassVar[str] = "PROTOCOL_INFO"
    version: int = _f(_U16)
    supported_versions: tuple[int, ...] = _f(_seq(_U16, 64, non_empty=True))
    schema: str = _f(_ident)
    max_frame_bytes: int = _f(_U32)
    server: str = _f(_ident)
    server_version: str = _f(_ident)

    def _validate(self) -> None:
        if self.version not in self.supported_versions:
            _fail("version", "must be one of supported_versions")


@dataclass(frozen=True)
class ErrorMessage(_Message):
    """A P4 error for task ``task_id`` (None: the connection); build with :meth:`of`."""
    TYPE: ClassVar[str] = "ERROR"
    error: ErrorBody = _f(_record(ErrorBody))
    task_id: str | None = _f(_ident, None)

    @classmethod
    def of(cls, error: ApplianceError, task_id: str | None = None) -> ErrorMessage:
        return cls(ErrorBody(error.code, error.message, error.retryable, dict(error.details)), task_id)


Message = (TaskStart | InferRequest | StreamToken | Heartbeat | TaskComplete | Cancel | ProtocolInfoRequest
           | ProtocolInfo | ErrorMessage)
MESSAGE_TYPES: dict[str, type[_Message]] = {c.TYPE: c for c in (
    TaskStart, InferRequest, StreamToken, Heartbeat, TaskComplete, Cancel, ProtocolInfo, ErrorMessage)}


def parse_message(payload: dict[str, Any]) -> Message:
    """The message for a received payload, or a non-fatal :class:`RemoteProtocolError` (BAD_PAYLOAD) whose
    ``task_id`` is the payload's (if valid) and whose ``details`` hold ``field``, ``reason`` and ``type``."""
    kind, task_id = (payload.get("type"), payload.get("task_id")) if isinstance(payload, dict) else (None, None)
    task_id = task_id if _is_id(task_id) else None
    try:
        cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
        if cls is None:
            _fail("type", "unknown message type" if isinstance(payload, dict) else "payload is not an object")
        if cls is ProtocolInfo and payload.keys() == {"type"}:
            return ProtocolInfoRequest()
        return _build(cls, {k: v for k, v in payload.items() if k != "type"}, "")
    except LocalProtocolError as exc:
        raise RemoteProtocolError("BAD_PAYLOAD", exc.error.message, task_id=task_id, fatal=False,
                                  details={**exc.error.details, "type": kind}) from None


def encode_message(message: Message, *, version: int = VERSION, max_frame_bytes: int | None = None) -> bytes:
    """``encode_frame(message.to_payload(), ...)``; raises :class:`LocalProtocolError`."""
    return encode_frame(message.to_payload(), version=version, max_frame_bytes=max_frame_bytes)
