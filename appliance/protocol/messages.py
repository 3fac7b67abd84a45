"""MAGN messages (SPEC P3): frozen dataclasses, one per JSON ``type``, each field declaring its own check.

Validation
----------

Construction validates and raises :class:`~appliance.protocol.frames.LocalProtocolError` (``BAD_PAYLOAD``,
``details = {"field", "reason"}``). It also normalises: lists become tuples, dicts become records (``usage``,
``tool_call``, ...), ints become floats where a number is expected; so ``parse_message(m.to_payload()) == m``.

Fields added to version 1 after its first release (``tool_choice``, ``logprobs`` and the sampling settings of
INFER_REQUEST, a chat message's ``tool_calls`` and ``tool_call_id``, a tool call's ``id``) are optional and left out
of a payload while they are null, so a peer that does not know them still reads every message that does not use
them.

:func:`parse_message` refuses unknown types and missing, unknown or invalid fields with a non-fatal
:class:`~appliance.protocol.frames.RemoteProtocolError` (the framing is intact, the connection can go on).

Tasks
-----

- The client picks a ``task_id`` for each TASK_START, INFER_REQUEST, EMBED_REQUEST and CANCEL; many may be in
  flight at once.
- TASK_START is answered by its echo with ``status``.
- INFER_REQUEST is answered by any STREAM_TOKEN / HEARTBEAT and then one TASK_COMPLETE or ERROR, all with its
  ``task_id``.
- EMBED_REQUEST (a message type added to version 1 later: a server that does not know it refuses it with a
  non-fatal BAD_PAYLOAD) is answered by one EMBEDDINGS or ERROR with its ``task_id``.
- CANCEL ends that task with ERROR ``CANCELLED`` (ignored for unknown or finished tasks).
- ERROR with a null ``task_id`` concerns the connection.
- PROTOCOL_INFO without fields asks; the reply PROTOCOL_INFO carries them all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, NoReturn

from appliance.errors import TABLE, ApplianceError
from appliance.protocol.frames import (
    VERSION,
    LocalProtocolError,
    RemoteProtocolError,
    check_json,
    encode_frame,
    is_valid_unicode,
)
from appliance.protocol.identifiers import agent_id_problem

SCHEMA = "magn/1"
MAX_ID_CHARS = 256
"""Task ids, model names and other names; a ``session_id`` names an agent and follows the agents' one rule
(:mod:`appliance.protocol.identifiers`)."""
MAX_TOKENS_LIMIT = 131072
MAX_STOP_STRINGS = 16
MAX_CHAT_MESSAGES = 4096
MAX_SUPPORTED_VERSIONS = 64
MAX_TOOL_CALLS = 128
ROLES = ("system", "user", "assistant", "tool")
STOP_REASONS = ("stop", "length", "tool_call")
TOOL_CHOICES = ("auto", "none", "required")
MAX_SEED = 2**32 - 2
MAX_TOP_K = 1 << 20
MAX_EMBED_INPUTS = 2048
"""Texts one EMBED_REQUEST may hold (as ``POST /v1/embeddings``'s ``input``)."""
MAX_EMBED_DIMENSIONS = 1 << 20

_MAX_EXACT_FLOAT_INT = 2**53  # larger ints do not survive the conversion to float

Check = Callable[[Any, str], Any]
"""A field check: ``check(value, field_name)`` returns the normalised value or raises via :func:`_fail`."""


def _fail(name: str, reason: str) -> NoReturn:
    raise LocalProtocolError("BAD_PAYLOAD", f"{name}: {reason}", details={"field": name, "reason": reason})


def _field(check: Check, default: Any = MISSING, *, default_factory: Any = MISSING, omit_null: bool = False) -> Any:
    """A dataclass field validated by ``check``.

    A field whose default is None may be None (JSON null): the check is skipped for it. An ``omit_null`` field (one
    added to version 1 later) is left out of the payload while it is None.
    """
    metadata = {"check": check, "nullable": default is None, "omit_null": omit_null}
    return field(default=default, default_factory=default_factory, metadata=metadata)


# --- field checks ----------------------------------------------------------------------------------------------------


def _is_identifier(value: Any) -> bool:
    """A non-empty string of at most :data:`MAX_ID_CHARS` characters, valid Unicode."""
    if not isinstance(value, str):
        return False
    if not 0 < len(value) <= MAX_ID_CHARS:
        return False
    return is_valid_unicode(value)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_identifier(value: Any, name: str) -> str:
    if not _is_identifier(value):
        _fail(name, f"must be a string of 1 to {MAX_ID_CHARS} valid characters")
    return value


def _check_agent_id(value: Any, name: str) -> str:
    problem = agent_id_problem(value)
    if problem is not None:
        _fail(name, problem)
    return value


def _check_text(value: Any, name: str) -> str:
    if not isinstance(value, str) or not is_valid_unicode(value):
        _fail(name, "must be a string of valid Unicode")
    return value


def _check_boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        _fail(name, "must be a boolean")
    return value


def _check_error_code(value: Any, name: str) -> str:
    if not isinstance(value, str) or value not in TABLE:
        _fail(name, "must be a code of the appliance's error table")
    return value


def _check_json_object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        _fail(name, "must be a JSON object")
    check_json(value, name)
    return value


def _check_tool_choice(value: Any, name: str) -> str | dict[str, Any]:
    """``auto``, ``none``, ``required``, or a JSON object (OpenAI's ``{"type": "function", "function": {"name": ...}}``,
    checked against the session's tools by the server)."""
    if isinstance(value, str) and value in TOOL_CHOICES:
        return value
    if not isinstance(value, dict):
        _fail(name, f"must be one of {list(TOOL_CHOICES)} or a JSON object naming a function")
    check_json(value, name)
    return value


def _check_json_array_or_object(value: Any, name: str) -> list[Any] | dict[str, Any]:
    if not isinstance(value, list | dict):
        _fail(name, "must be a JSON array or object")
    check_json(value, name)
    return value


def _one_of(choices: tuple[str, ...]) -> Check:
    """A check that the value is one of ``choices``."""
    reason = f"must be one of {list(choices)}"

    def check(value: Any, name: str) -> str:
        if value not in choices:
            _fail(name, reason)
        return value

    return check


def _integer(low: int, high: int) -> Check:
    """A check for an int (not a bool) in [low, high]."""
    reason = f"must be an integer in [{low}, {high}]"

    def check(value: Any, name: str) -> int:
        if not _is_int(value) or not low <= value <= high:
            _fail(name, reason)
        return int(value)

    return check


def _number(low: float, high: float, *, open_low: bool = False) -> Check:
    """A check for a finite float or an exactly convertible int, in [low, high] (``open_low``: in (low, high]).

    The value is returned as a float.
    """
    bracket = "(" if open_low else "["
    reason = f"must be a number in {bracket}{low}, {high}]"

    def in_range(value: float) -> bool:
        if open_low:
            return low < value <= high
        return low <= value <= high

    def check(value: Any, name: str) -> float:
        if _is_int(value):
            is_number = abs(value) <= _MAX_EXACT_FLOAT_INT
        else:
            is_number = isinstance(value, float) and math.isfinite(value)
        if not is_number or not in_range(value):
            _fail(name, reason)
        return float(value)

    return check


def _array(item: Check, max_entries: int, *, non_empty: bool = False) -> Check:
    """A check for a list (or tuple) of ``item``s, returned as a tuple; items are named ``name[i]``."""
    min_entries = 1 if non_empty else 0
    reason = f"must be an array of {min_entries} to {max_entries} entries"

    def check(value: Any, name: str) -> tuple[Any, ...]:
        if not isinstance(value, list | tuple) or not min_entries <= len(value) <= max_entries:
            _fail(name, reason)
        items = []
        for index, entry in enumerate(value):
            items.append(item(entry, f"{name}[{index}]"))
        return tuple(items)

    return check


def _record(cls: type[_Record]) -> Check:
    """A check for a nested record: an instance of ``cls``, or a JSON object built into one."""

    def check(value: Any, name: str) -> Any:
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            _fail(name, "must be a JSON object")
        return _build(cls, value, name)

    return check


_check_count = _integer(0, 2**31 - 1)
_check_uint16 = _integer(0, 0xFFFF)
_check_uint32 = _integer(0, 0xFFFFFFFF)
_check_max_tokens = _integer(1, MAX_TOKENS_LIMIT)
_check_non_negative = _number(0.0, math.inf)
_check_logprob = _number(-math.inf, 0.0)
_check_temperature = _number(0.0, 2.0)
_check_top_p = _number(0.0, 1.0, open_low=True)
_check_seed = _integer(0, MAX_SEED)
_check_top_k = _integer(0, MAX_TOP_K)
_check_min_p = _number(0.0, 1.0)
_check_repeat_penalty = _number(0.0, 10.0, open_low=True)
_check_openai_penalty = _number(-2.0, 2.0)
_check_stop_strings = _array(_check_identifier, MAX_STOP_STRINGS)
_check_supported_versions = _array(_check_uint16, MAX_SUPPORTED_VERSIONS, non_empty=True)
_check_dimensions = _integer(1, MAX_EMBED_DIMENSIONS)
_check_embed_inputs = _array(_check_text, MAX_EMBED_INPUTS, non_empty=True)
_check_vectors = _array(_array(_number(-math.inf, math.inf), MAX_EMBED_DIMENSIONS, non_empty=True), MAX_EMBED_INPUTS,
                        non_empty=True)


def _check_timings(value: Any, name: str) -> dict[str, float]:
    """A JSON object of numbers >= 0, each named ``name.key``."""
    if not isinstance(value, dict):
        _fail(name, "must be a JSON object of numbers")
    check_json(value, name)
    timings = {}
    for key, number in value.items():
        timings[key] = _check_non_negative(number, f"{name}.{key}")
    return timings


# --- records ---------------------------------------------------------------------------------------------------------


_SHAPES: dict[type, tuple[frozenset[str], tuple[str, ...]]] = {}


def _shape(cls: type[_Record]) -> tuple[frozenset[str], tuple[str, ...]]:
    """The field names of ``cls`` and, in their order, those without a default (read once per class)."""
    shape = _SHAPES.get(cls)
    if shape is None:
        declared = fields(cls)  # type: ignore[arg-type]
        shape = (frozenset(f.name for f in declared),
                 tuple(f.name for f in declared if f.default is MISSING and f.default_factory is MISSING))
        _SHAPES[cls] = shape
    return shape


def _build(cls: type[_Record], data: dict[str, Any], name: str) -> Any:
    """``cls(**data)`` for a payload dict, with missing/unknown keys and inner errors named under ``name``."""
    prefix = f"{name}." if name else ""
    known, required = _shape(cls)
    for key in data:
        if key not in known:
            _fail(f"{prefix}{key}", "unknown field")
    for key in required:
        if key not in data:
            _fail(f"{prefix}{key}", "missing")
    try:
        return cls(**data)
    except LocalProtocolError as exc:
        _fail(f"{prefix}{exc.error.details['field']}", exc.error.details["reason"])


FieldSpec = tuple[str, Check, bool, bool]
"""A record field as the hot paths read it: its name, check, whether it may be null, whether null is left out."""
_FIELD_SPECS: dict[type, tuple[FieldSpec, ...]] = {}


def _field_specs(record: Any) -> tuple[FieldSpec, ...]:
    """The fields of ``record``'s class, read from its dataclass fields once per class (every frame sent or
    received builds records: ``dataclasses.fields`` and the metadata look-ups per record were a share of it)."""
    kind = type(record)
    specs = _FIELD_SPECS.get(kind)
    if specs is None:
        specs = tuple((declared.name, declared.metadata["check"], declared.metadata["nullable"],
                       declared.metadata["omit_null"]) for declared in fields(record))
        _FIELD_SPECS[kind] = specs
    return specs


def _dump(value: Any) -> Any:
    """The JSON value of a record field: records as dicts, tuples as lists."""
    if isinstance(value, _Record):
        dumped = {}
        for name, _, _, omit_null in _field_specs(value):
            item = getattr(value, name)
            if item is None and omit_null:
                continue
            dumped[name] = _dump(item)
        return dumped
    if isinstance(value, tuple | list):
        return [_dump(item) for item in value]
    if isinstance(value, dict):
        return dict(value)
    return value


class _Record:
    """Base of the frozen dataclasses here: runs each field's check, then :meth:`_validate`."""

    def __post_init__(self) -> None:
        for name, check, nullable, _ in _field_specs(self):
            value = getattr(self, name)
            if value is None and nullable:
                continue
            object.__setattr__(self, name, check(value, name))
        self._validate()

    def _validate(self) -> None:
        """Rules across fields; subclasses override."""


@dataclass(frozen=True)
class ToolCall(_Record):
    """A call of the tool ``name``; ``id`` is the server's (a TASK_COMPLETE's call), sent back in the history as the
    assistant message's call and as the ``tool_call_id`` of its result."""

    name: str = _field(_check_identifier)
    arguments: dict[str, Any] = _field(_check_json_object, default_factory=dict)
    id: str | None = _field(_check_identifier, None, omit_null=True)


@dataclass(frozen=True)
class ChatMessage(_Record):
    """One message of a chat; an ``assistant`` message may hold the ``tool_calls`` it made, a ``tool`` message (a
    call's result) the ``tool_call_id`` it answers."""

    role: str = _field(_one_of(ROLES))
    content: str = _field(_check_text)
    tool_calls: tuple[ToolCall, ...] | None = _field(_array(_record(ToolCall), MAX_TOOL_CALLS, non_empty=True), None,
                                                     omit_null=True)
    tool_call_id: str | None = _field(_check_identifier, None, omit_null=True)

    def _validate(self) -> None:
        if self.tool_calls is not None and self.role != "assistant":
            _fail("tool_calls", "only allowed in an assistant message")
        if self.tool_call_id is not None and self.role != "tool":
            _fail("tool_call_id", "only allowed in a tool message")


@dataclass(frozen=True)
class Usage(_Record):
    prompt_tokens: int = _field(_check_count)
    completion_tokens: int = _field(_check_count)


@dataclass(frozen=True)
class ErrorBody(_Record):
    """The P4 shape; ``retryable`` is always the table's value for ``code``, an empty message its summary."""

    code: str = _field(_check_error_code)
    message: str = _field(_check_text, "")
    retryable: bool = _field(_check_boolean, False)
    details: dict[str, Any] = _field(_check_json_object, default_factory=dict)

    def _validate(self) -> None:
        kind = TABLE[self.code]
        if not self.message:
            object.__setattr__(self, "message", kind.summary)
        object.__setattr__(self, "retryable", kind.retryable)

    def exception(self) -> ApplianceError:
        return ApplianceError(self.code, self.message, dict(self.details))


# --- messages --------------------------------------------------------------------------------------------------------


class _Message(_Record):
    TYPE: ClassVar[str]  # the payload's "type"

    def to_payload(self) -> dict[str, Any]:
        """The JSON object to send: ``{"type": TYPE, <every field>}`` (None as null, tuples as lists)."""
        return {"type": self.TYPE, **_dump(self)}


@dataclass(frozen=True)
class TaskStart(_Message):
    """Open the agent session ``session_id`` on ``model``; the server's echo sets ``status`` (e.g. "started").

    ``tools``: the functions the session's chat requests may call, as OpenAI's ``tools`` (a list of ``{"type":
    "function", "function": {"name", "description", "parameters"}}``); the server checks them (BAD_REQUEST)."""

    TYPE: ClassVar[str] = "TASK_START"
    task_id: str = _field(_check_identifier)
    session_id: str = _field(_check_agent_id)
    model: str = _field(_check_identifier)
    tools: list[Any] | dict[str, Any] | None = _field(_check_json_array_or_object, None)
    status: str | None = _field(_check_identifier, None)


@dataclass(frozen=True)
class InferRequest(_Message):
    """Generate: exactly one of ``prompt``/``messages``; ``session_id`` (an agent's conversation) or ``model``.

    ``prompt`` is raw text; ``messages`` are rendered with the model's chat template (and the session's tools).
    ``tool_choice`` (messages only): ``auto`` (the default), ``none``, ``required`` or OpenAI's named function.
    ``logprobs`` (streams only): each STREAM_TOKEN carries its ``logprob``. ``seed``, ``top_k``, ``min_p``,
    ``repeat_penalty`` (llama.cpp's, 1 is off), ``frequency_penalty`` and ``presence_penalty`` (OpenAI's, 0 is off):
    None is the engine's default."""

    TYPE: ClassVar[str] = "INFER_REQUEST"
    task_id: str = _field(_check_identifier)
    model: str | None = _field(_check_identifier, None)
    session_id: str | None = _field(_check_agent_id, None)
    prompt: str | None = _field(_check_text, None)
    messages: tuple[ChatMessage, ...] | None = _field(
        _array(_record(ChatMessage), MAX_CHAT_MESSAGES, non_empty=True), None
    )
    max_tokens: int = _field(_check_max_tokens, 256)
    temperature: float = _field(_check_temperature, 0.8)
    top_p: float = _field(_check_top_p, 0.95)
    stop: tuple[str, ...] = _field(_check_stop_strings, ())
    stream: bool = _field(_check_boolean, False)
    tool_choice: str | dict[str, Any] | None = _field(_check_tool_choice, None, omit_null=True)
    logprobs: bool | None = _field(_check_boolean, None, omit_null=True)
    seed: int | None = _field(_check_seed, None, omit_null=True)
    top_k: int | None = _field(_check_top_k, None, omit_null=True)
    min_p: float | None = _field(_check_min_p, None, omit_null=True)
    repeat_penalty: float | None = _field(_check_repeat_penalty, None, omit_null=True)
    frequency_penalty: float | None = _field(_check_openai_penalty, None, omit_null=True)
    presence_penalty: float | None = _field(_check_openai_penalty, None, omit_null=True)

    def _validate(self) -> None:
        if self.model is None and self.session_id is None:
            _fail("model", "one of model or session_id is required")
        if (self.prompt is None) == (self.messages is None):
            _fail("prompt", "exactly one of prompt or messages is required")
        if self.tool_choice is not None and self.messages is None:
            _fail("tool_choice", "only allowed with messages (a prompt is raw text)")
        if self.logprobs and not self.stream:
            _fail("logprobs", "only allowed with stream (each STREAM_TOKEN carries its logprob)")


@dataclass(frozen=True)
class StreamToken(_Message):
    """One generated token of a streaming task; ``timestamp`` in seconds since the epoch."""

    TYPE: ClassVar[str] = "STREAM_TOKEN"
    task_id: str = _field(_check_identifier)
    text: str = _field(_check_text)
    token_id: int = _field(_check_count)
    timestamp: float = _field(_check_non_negative)
    logprob: float | None = _field(_check_logprob, None)


@dataclass(frozen=True)
class Heartbeat(_Message):
    """The task is alive but produced no token for a while."""

    TYPE: ClassVar[str] = "HEARTBEAT"
    task_id: str = _field(_check_identifier)
    timestamp: float | None = _field(_check_non_negative, None)


@dataclass(frozen=True)
class TaskComplete(_Message):
    """A result; ``timings``: name -> number >= 0 (``ttft_ms``...), ``stats``: free JSON (plan, threads...).

    ``tool_call`` is present exactly when ``stop_reason`` is ``"tool_call"``: a ``"tool_call"`` stop without a
    ``tool_call``, and a ``tool_call`` with another stop reason, are both refused with ``field == "tool_call"``.
    """

    TYPE: ClassVar[str] = "TASK_COMPLETE"
    task_id: str = _field(_check_identifier)
    text: str = _field(_check_text)
    usage: Usage = _field(_record(Usage))
    stop_reason: str = _field(_one_of(STOP_REASONS))
    timings: dict[str, float] = _field(_check_timings, default_factory=dict)
    tool_call: ToolCall | None = _field(_record(ToolCall), None)
    stats: dict[str, Any] = _field(_check_json_object, default_factory=dict)

    def _validate(self) -> None:
        if self.stop_reason == "tool_call" and self.tool_call is None:
            _fail("tool_call", "required when stop_reason is 'tool_call'")
        if self.stop_reason != "tool_call" and self.tool_call is not None:
            _fail("tool_call", "only allowed when stop_reason is 'tool_call'")


@dataclass(frozen=True)
class EmbedRequest(_Message):
    """The embeddings of ``input`` (texts, in order) from ``model``, whose ``models[].embeddings`` must be true;
    ``dimensions``, if given, must be the model's."""

    TYPE: ClassVar[str] = "EMBED_REQUEST"
    task_id: str = _field(_check_identifier)
    model: str = _field(_check_identifier)
    input: tuple[str, ...] = _field(_check_embed_inputs)
    dimensions: int | None = _field(_check_dimensions, None, omit_null=True)


@dataclass(frozen=True)
class EmbedUsage(_Record):
    prompt_tokens: int = _field(_check_count)


@dataclass(frozen=True)
class Embeddings(_Message):
    """An EMBED_REQUEST's answer: one unit vector per input, in order, all of ``dimensions`` numbers, and the
    tokens the inputs were."""

    TYPE: ClassVar[str] = "EMBEDDINGS"
    task_id: str = _field(_check_identifier)
    model: str = _field(_check_identifier)
    data: tuple[tuple[float, ...], ...] = _field(_check_vectors)
    usage: EmbedUsage = _field(_record(EmbedUsage))

    def _validate(self) -> None:
        if len({len(vector) for vector in self.data}) != 1:
            _fail("data", "every vector must have the same number of dimensions")


@dataclass(frozen=True)
class Cancel(_Message):
    """Stop the task ``task_id``."""

    TYPE: ClassVar[str] = "CANCEL"
    task_id: str = _field(_check_identifier)


@dataclass(frozen=True)
class ProtocolInfoRequest(_Message):
    """PROTOCOL_INFO with no fields: ask the server what it speaks."""

    TYPE: ClassVar[str] = "PROTOCOL_INFO"


@dataclass(frozen=True)
class ProtocolInfo(_Message):
    """The server's PROTOCOL_INFO reply."""

    TYPE: ClassVar[str] = "PROTOCOL_INFO"
    version: int = _field(_check_uint16)
    supported_versions: tuple[int, ...] = _field(_check_supported_versions)
    schema: str = _field(_check_identifier)
    max_frame_bytes: int = _field(_check_uint32)
    server: str = _field(_check_identifier)
    server_version: str = _field(_check_identifier)

    def _validate(self) -> None:
        if self.version not in self.supported_versions:
            _fail("version", "must be one of supported_versions")


@dataclass(frozen=True)
class ErrorMessage(_Message):
    """A P4 error for task ``task_id`` (None: the connection); build with :meth:`of`."""

    TYPE: ClassVar[str] = "ERROR"
    error: ErrorBody = _field(_record(ErrorBody))
    task_id: str | None = _field(_check_identifier, None)

    @classmethod
    def of(cls, error: ApplianceError, task_id: str | None = None) -> ErrorMessage:
        body = ErrorBody(error.code, error.message, error.retryable, dict(error.details))
        return cls(body, task_id)


Message = (
    TaskStart
    | InferRequest
    | StreamToken
    | Heartbeat
    | TaskComplete
    | EmbedRequest
    | Embeddings
    | Cancel
    | ProtocolInfoRequest
    | ProtocolInfo
    | ErrorMessage
)

MESSAGE_TYPES: dict[str, type[_Message]] = {
    "TASK_START": TaskStart,
    "INFER_REQUEST": InferRequest,
    "STREAM_TOKEN": StreamToken,
    "HEARTBEAT": Heartbeat,
    "TASK_COMPLETE": TaskComplete,
    "EMBED_REQUEST": EmbedRequest,
    "EMBEDDINGS": Embeddings,
    "CANCEL": Cancel,
    "PROTOCOL_INFO": ProtocolInfo,  # or ProtocolInfoRequest when it has no fields: see parse_message
    "ERROR": ErrorMessage,
}
"""The message class of each payload ``type``."""


def parse_message(payload: dict[str, Any]) -> Message:
    """The message for a received payload, or a non-fatal :class:`RemoteProtocolError` (BAD_PAYLOAD).

    The error's ``task_id`` is the payload's (if valid) and its ``details`` hold ``field``, ``reason`` and
    ``type``.
    """
    kind = None
    task_id = None
    if isinstance(payload, dict):
        kind = payload.get("type")
        task_id = payload.get("task_id")
    if not _is_identifier(task_id):
        task_id = None
    try:
        return _parse(payload, kind)
    except LocalProtocolError as exc:
        details = {**exc.error.details, "type": kind}
        raise RemoteProtocolError("BAD_PAYLOAD", exc.error.message, details=details, task_id=task_id,
                                  fatal=False) from None


def _parse(payload: Any, kind: Any) -> Message:
    """:func:`parse_message` with :class:`LocalProtocolError` for what is wrong."""
    if not isinstance(payload, dict):
        _fail("type", "payload is not an object")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        _fail("type", "unknown message type")
    if cls is ProtocolInfo and payload.keys() == {"type"}:
        return ProtocolInfoRequest()
    data = {key: value for key, value in payload.items() if key != "type"}
    return _build(cls, data, "")


def encode_message(message: Message, *, version: int = VERSION, max_frame_bytes: int | None = None) -> bytes:
    """``encode_frame(message.to_payload(), ...)``; raises :class:`LocalProtocolError`."""
    return encode_frame(message.to_payload(), version=version, max_frame_bytes=max_frame_bytes)
