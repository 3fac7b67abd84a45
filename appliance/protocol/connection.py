"""A sans-IO MAGN connection (SPEC P3): the frame codec plus the conversation rules, like h11's ``Connection``.

One :class:`Connection` is one side of one MAGN conversation: ``Connection(CLIENT)`` in a client,
``Connection(SERVER)`` in the server. Bytes go in with :meth:`Connection.receive_data` (``b""``: the peer ended its
stream), messages come out of :meth:`Connection.next_event` (or :data:`NEED_DATA` / :data:`CLOSED`), and
:meth:`Connection.send` turns a message of ours into the bytes to write. Nothing here touches a socket.

The rules of the conversation are one table, :data:`RULES`: for each message type, which role sends it and what it
does to the tasks in flight (key ``task_id``, tracked in both directions):

==================  ======  ==========  =================================================
message             sender  effect      tasks it concerns
==================  ======  ==========  =================================================
PROTOCOL_INFO       client  ASK         (the connection: the server owes one reply)
PROTOCOL_INFO       server  ANSWER      (the connection: settles one ASK)
TASK_START          client  OPEN        opens a ``TASK_START`` task
TASK_START (echo)   server  END         ``TASK_START``
INFER_REQUEST       client  OPEN        opens an ``INFER_REQUEST`` task
CANCEL              client  CANCEL      ``INFER_REQUEST`` (late or unknown: ignored)
STREAM_TOKEN        server  IN_TASK     ``INFER_REQUEST``
HEARTBEAT           server  IN_TASK     ``INFER_REQUEST``
TASK_COMPLETE       server  END         ``INFER_REQUEST``
EMBED_REQUEST       client  OPEN        opens an ``EMBED_REQUEST`` task
EMBEDDINGS          server  END         ``EMBED_REQUEST``
ERROR               server  END         any kind; a null ``task_id`` is about the connection
==================  ======  ==========  =================================================

Breaking a rule raises, and changes no state:

* our side (:meth:`~Connection.send`): :class:`~appliance.protocol.frames.LocalProtocolError`; nothing is produced.
* the peer (:meth:`~Connection.next_event`): a non-fatal :class:`~appliance.protocol.frames.RemoteProtocolError`
  carrying the message's ``task_id``; the framing is intact and the next call goes on with the next message.
  A type sent by the wrong role is ``BAD_PAYLOAD`` ("HEARTBEAT is sent by the server, not to it"); an ``OPEN``
  whose ``task_id`` is in flight, a message for a task not in flight (or of the other kind) and an unasked
  PROTOCOL_INFO reply are ``BAD_REQUEST``.

A CANCEL for a task that is not in flight (it already ended: the CANCEL crossed its last message; or it never
existed) is *late*: it is allowed to send, and on receipt :meth:`~Connection.next_event` drops it (counted in
:attr:`~Connection.ignored_cancels`) and goes on with the next message, so a session only ever sees CANCELs for tasks
in flight.

Refusals: when :meth:`~Connection.next_event` raised a non-fatal error with a ``task_id`` and our role may send
ERROR (the server), the connection owes that peer an ERROR for that ``task_id``: the next ERROR we send with it is the
refusal and leaves the tasks in flight alone (so refusing a duplicate ``task_id`` does not end the original task).
An ERROR with a null ``task_id`` may always be sent.

States (:attr:`~Connection.state`): ``OPEN``; ``CLOSED`` once the peer ended its stream and every message was
returned; ``ERROR`` after a fatal :class:`~appliance.protocol.frames.RemoteProtocolError` (the framing is lost): every
later ``receive_data`` / ``next_event`` raises it again. Only what we *receive* is closed or broken: :meth:`send`
works in every state (a server says why it closes, the tasks in flight still end).
"""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from appliance.protocol import messages as m
from appliance.protocol.frames import (
    CLOSED,
    DEFAULT_MAX_FRAME_BYTES,
    NEED_DATA,
    Frame,
    FrameParser,
    LocalProtocolError,
    ParserState,
    ProtocolError,
    RemoteProtocolError,
    Sentinel,
)

__all__ = ["CLIENT", "CLOSED", "NEED_DATA", "RULES", "SERVER", "Connection", "ConnectionState", "Effect", "Role",
           "Rule", "rule_for"]


class Role(enum.Enum):
    """The two sides of a MAGN conversation."""

    CLIENT = "client"
    SERVER = "server"

    @property
    def peer(self) -> Role:
        return Role.SERVER if self is Role.CLIENT else Role.CLIENT

    def __repr__(self) -> str:
        return self.name


CLIENT = Role.CLIENT
SERVER = Role.SERVER


class Effect(enum.Enum):
    """What a message does to the conversation's state."""

    ASK = "asks"  # a PROTOCOL_INFO request: one reply is owed
    ANSWER = "answers"  # a PROTOCOL_INFO reply: settles one ASK
    OPEN = "opens"  # opens the task task_id, which must not be in flight
    IN_TASK = "belongs to"  # belongs to the task task_id, which must be in flight
    END = "ends"  # belongs to the task task_id, which must be in flight, and ends it
    CANCEL = "cancels"  # asks to end the task task_id; late (not in flight) is ignored


@dataclass(frozen=True)
class Rule:
    """One row of :data:`RULES`: ``message`` is sent by ``sender`` with ``effect`` on a task whose opening message is
    one of ``tasks`` (for IN_TASK, END and CANCEL)."""

    message: type[m.Message]
    sender: Role
    effect: Effect
    tasks: tuple[type[m.Message], ...] = ()


RULES: tuple[Rule, ...] = (
    Rule(m.ProtocolInfoRequest, CLIENT, Effect.ASK),
    Rule(m.ProtocolInfo, SERVER, Effect.ANSWER),
    Rule(m.TaskStart, CLIENT, Effect.OPEN),
    Rule(m.TaskStart, SERVER, Effect.END, (m.TaskStart,)),
    Rule(m.InferRequest, CLIENT, Effect.OPEN),
    Rule(m.Cancel, CLIENT, Effect.CANCEL, (m.InferRequest,)),
    Rule(m.StreamToken, SERVER, Effect.IN_TASK, (m.InferRequest,)),
    Rule(m.Heartbeat, SERVER, Effect.IN_TASK, (m.InferRequest,)),
    Rule(m.TaskComplete, SERVER, Effect.END, (m.InferRequest,)),
    Rule(m.EmbedRequest, CLIENT, Effect.OPEN),
    Rule(m.Embeddings, SERVER, Effect.END, (m.EmbedRequest,)),
    Rule(m.ErrorMessage, SERVER, Effect.END,
         (m.TaskStart, m.InferRequest, m.EmbedRequest)),  # task_id None: the connection
)
"""The conversation rules, one row per (message type, sender); a pair that is not here is not allowed."""

_BY_KEY: dict[tuple[type[m.Message], Role], Rule] = {(rule.message, rule.sender): rule for rule in RULES}


def rule_for(message_type: type[m.Message], sender: Role) -> Rule | None:
    """The row of :data:`RULES` for ``message_type`` sent by ``sender``, or None if that is not allowed."""
    return _BY_KEY.get((message_type, sender))


class ConnectionState(enum.Enum):
    OPEN = "OPEN"
    CLOSED = "CLOSED"
    ERROR = "ERROR"


Event = m.Message | Literal[Sentinel.NEED_DATA, Sentinel.CLOSED]


class Connection:
    """One side of a MAGN conversation; see the module docstring for the rules, refusals and states.

    It owns the frame parser (``max_frame_bytes`` may be changed at any time: the next header is checked against the
    new value), the tasks in flight in both directions (:attr:`in_flight`), the PROTOCOL_INFO requests not yet
    answered, and the ERRORs owed as refusals. ``on_frame(frame, length)``, if set, sees every received frame before
    it is parsed as a message (for debug logs).
    """

    def __init__(self, our_role: Role, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 on_frame: Callable[[Frame, int], None] | None = None) -> None:
        self.our_role = our_role
        self.their_role = our_role.peer
        self.on_frame = on_frame
        self.ignored_cancels = 0  # late CANCELs received and dropped
        self._parser = FrameParser(max_frame_bytes)
        self._tasks: dict[str, type[m.Message]] = {}  # task_id -> the type of its opening message
        self._asked = 0  # PROTOCOL_INFO requests not yet answered
        self._refusals: Counter[str] = Counter()  # task_id -> ERRORs we owe as refusals
        self._may_refuse = rule_for(m.ErrorMessage, our_role) is not None
        self._error: RemoteProtocolError | None = None

    # -- state ------------------------------------------------------------------------------------------------------

    @property
    def max_frame_bytes(self) -> int:
        return self._parser.max_frame_bytes

    @max_frame_bytes.setter
    def max_frame_bytes(self, value: int) -> None:
        if value < 0:
            raise ValueError("max_frame_bytes must be >= 0")
        self._parser.max_frame_bytes = value

    @property
    def state(self) -> ConnectionState:
        if self._error is not None:
            return ConnectionState.ERROR
        if self._parser.state is ParserState.CLOSED:
            return ConnectionState.CLOSED
        return ConnectionState.OPEN

    @property
    def in_flight(self) -> Mapping[str, str]:
        """The tasks in flight: ``task_id`` -> the TYPE of the message that opened it (a read-only view)."""
        return MappingProxyType({task_id: kind.TYPE for task_id, kind in self._tasks.items()})

    @property
    def info_requests_pending(self) -> int:
        """PROTOCOL_INFO requests sent or received and not yet answered."""
        return self._asked

    @property
    def trailing_data(self) -> bytes:
        """Bytes received and not yet part of a returned message."""
        return self._parser.trailing_data

    @property
    def buffered_bytes(self) -> int:
        """How many bytes are received and not yet part of a returned message (no copy)."""
        return self._parser.buffered_bytes

    @property
    def pending_frame_bytes(self) -> int:
        """The size, header included, of the frame being received as its header announces it (0 when nothing is
        buffered; while the header is incomplete, the bytes buffered). Once ``buffered_bytes`` reaches it, the
        next :meth:`next_event` parses that frame, in time proportional to its size: a server session can run
        that call off its event loop when it is large (``await asyncio.to_thread(conn.next_event)``)."""
        return self._parser.pending_frame_bytes

    # -- receiving ------------------------------------------------------------------------------------------------

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        """Buffer received bytes; ``b""`` says the peer ended its stream. In the ERROR state re-raises the error."""
        if self._error is not None:
            raise self._error
        self._parser.receive_data(data)

    def next_event(self) -> Event:
        """The next message from the peer, :data:`NEED_DATA` or :data:`CLOSED`.

        Raises :class:`RemoteProtocolError`: non-fatal ones (a bad payload, a broken rule) concern one frame only,
        and the next call goes on; after a fatal one the connection is in the ERROR state. Late CANCELs are dropped.
        """
        if self._error is not None:
            raise self._error
        while True:
            try:
                event = self._parser.next_event()
                if not isinstance(event, Frame):
                    return event
                if self.on_frame is not None:
                    self.on_frame(event, self._parser.last_length)
                message = m.parse_message(event.payload)
                if self._apply(message, self.their_role):
                    return message
                self.ignored_cancels += 1
            except RemoteProtocolError as exc:
                self._note(exc)
                raise

    def _note(self, exc: RemoteProtocolError) -> None:
        if exc.fatal:
            self._error = exc
        elif exc.task_id is not None and self._may_refuse:
            self._refusals[exc.task_id] += 1

    # -- sending --------------------------------------------------------------------------------------------------

    def send(self, message: m.Message) -> bytes:
        """The frame for our ``message``, once it passed the rules (else :class:`LocalProtocolError`, no state
        change). A late CANCEL is allowed and changes nothing."""
        data = m.encode_message(message)
        if isinstance(message, m.ErrorMessage) and message.task_id is not None and self._refusals[message.task_id]:
            self._refusals[message.task_id] -= 1  # the refusal we owe: the tasks in flight are not concerned
            if not self._refusals[message.task_id]:
                del self._refusals[message.task_id]
            return data
        self._apply(message, self.our_role)
        return data

    # -- the rules ------------------------------------------------------------------------------------------------

    def _apply(self, message: m.Message, sender: Role) -> bool:
        """Check ``message`` from ``sender`` against :data:`RULES` and update the state; False for a late CANCEL."""
        task_id: str | None = getattr(message, "task_id", None)
        rule = rule_for(type(message), sender)
        if rule is None:
            allowed = sender.peer.value
            text = f"{message.TYPE} is sent by the {allowed}, " + (
                "not to it" if sender is self.their_role else f"not by the {sender.value}")
            raise self._violation(sender, "BAD_PAYLOAD", text, {"type": message.TYPE}, task_id)
        effect = rule.effect
        if effect is Effect.ASK:
            self._asked += 1
        elif effect is Effect.ANSWER:
            if not self._asked:
                raise self._violation(sender, "BAD_REQUEST", f"{message.TYPE} reply without a request",
                                      {"type": message.TYPE}, None)
            self._asked -= 1
        elif task_id is None:  # only ERROR may have no task_id: it is about the whole connection
            pass
        elif effect is Effect.OPEN:
            if task_id in self._tasks:
                raise self._violation(sender, "BAD_REQUEST", "task_id already in flight on this connection",
                                      {"task_id": task_id}, task_id)
            self._tasks[task_id] = rule.message
        elif effect is Effect.CANCEL:
            return self._tasks.get(task_id) in rule.tasks
        else:  # IN_TASK, END
            kind = self._tasks.get(task_id)
            if kind is None:
                raise self._violation(sender, "BAD_REQUEST", f"{message.TYPE}: no task {task_id!r} in flight on "
                                      "this connection", {"task_id": task_id, "type": message.TYPE}, task_id)
            if kind not in rule.tasks:
                raise self._violation(sender, "BAD_REQUEST", f"{message.TYPE} does not belong to a {kind.TYPE} task",
                                      {"task_id": task_id, "type": message.TYPE, "task": kind.TYPE}, task_id)
            if effect is Effect.END:
                del self._tasks[task_id]
        return True

    def _violation(self, sender: Role, code: str, text: str, details: dict[str, Any],
                   task_id: str | None) -> ProtocolError:
        if sender is self.our_role:
            return LocalProtocolError(code, text, details=details, task_id=task_id)
        return RemoteProtocolError(code, text, details=details, task_id=task_id, fatal=False)
