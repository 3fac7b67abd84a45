"""The blocking MAGN client :class:`MagnClient`, and what it shares with the asyncio one (import both from
:mod:`appliance.client.aio`).

Shared (:class:`_ClientCore`): the sans-IO :class:`~appliance.protocol.connection.Connection` in the CLIENT role (the
framing and the conversation rules), a queue per task in flight (key ``task_id``; ``None`` for PROTOCOL_INFO), the
routing of received messages to those queues, the building of requests and of each task's :class:`Completion`.

:class:`MagnClient` is a plain blocking socket: a call writes its frame with one ``sendall``, then reads the socket
itself (large ``recv`` chunks fed to the connection) until its own task's next message is queued; what arrives
meanwhile for other tasks in flight (a stream left open, say) waits in their queues.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import Any, TypeVar

from appliance.protocol import messages as m
from appliance.protocol.connection import CLIENT, CLOSED, NEED_DATA, Connection
from appliance.protocol.frames import DEFAULT_MAX_FRAME_BYTES, RemoteProtocolError

_T = TypeVar("_T")
RECV_BYTES = 1 << 18  # one recv() takes up to this much: a whole burst of stream tokens at once
DRAIN_S = 1.0  # after a failed send, how long to read what the server said first


@dataclass(frozen=True)
class Completion:
    """The outcome of one INFER_REQUEST: its TASK_COMPLETE fields and the tokens streamed before it."""

    task_id: str
    text: str
    usage: m.Usage
    timings: dict[str, float]
    stop_reason: str
    tool_call: m.ToolCall | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    tokens: tuple[m.StreamToken, ...] = ()


def _expect(message: m.Message, cls: type[_T]) -> _T:
    """``message`` if it is a ``cls``; else raise the task's error (an ERROR) or an unexpected-message error."""
    if isinstance(message, cls):
        return message
    if isinstance(message, m.ErrorMessage):
        raise message.error.exception()
    raise RemoteProtocolError("BAD_PAYLOAD", f"unexpected {message.TYPE} for this task", fatal=False,
                              details={"field": "type", "reason": "unexpected message", "type": message.TYPE})


class _ClientCore:
    """What both clients own and do the same way.

    It owns the :class:`~appliance.protocol.connection.Connection` (CLIENT role), the queue of each task somebody
    waits for (key ``task_id``, ``None`` for PROTOCOL_INFO replies), the count of HEARTBEATs received, and the
    connection's failure. A subclass provides :meth:`_new_queue` (a queue with ``put_nowait``) and :meth:`_write`,
    and calls :meth:`_feed` with what it reads and :meth:`_fail` with what goes wrong.

    Routing (:meth:`_feed`): a task's messages go to its queue (dropped if nobody waits for it any more); HEARTBEATs
    are counted; a non-fatal protocol error about a task goes to that task's queue (dropped likewise, as the late
    messages of a task that already ended are); an ERROR with a null ``task_id``, any other protocol error and the
    end of the stream fail the connection.

    A failure (:meth:`_fail`) is put at the end of every queue, where it stays: the waiters get what was queued
    before it, then the failure, again and again; no task can be opened after it.
    """

    def __init__(self, path: str, max_frame_bytes: int) -> None:
        self.path = str(path)
        self.max_frame_bytes = max_frame_bytes
        self.heartbeats = 0  # HEARTBEAT messages received on this connection
        self._conn = Connection(CLIENT, max_frame_bytes=max_frame_bytes)
        self._queues: dict[str | None, Any] = {None: self._new_queue()}
        self._failure: BaseException | None = None
        self._ids = itertools.count(1)

    def _new_queue(self) -> Any:
        raise NotImplementedError

    def _write(self, data: bytes) -> None:
        raise NotImplementedError

    def _send(self, message: m.Message) -> None:
        if self._failure is not None:
            raise self._failure
        self._write(self._conn.send(message))

    def _feed(self, data: bytes) -> None:
        """Give received bytes (``b""``: end of stream) to the connection and route every message they complete.

        Raises what fails the connection; the caller passes it to :meth:`_fail`."""
        self._conn.receive_data(data)
        while True:
            try:
                event = self._conn.next_event()
            except RemoteProtocolError as exc:
                if exc.fatal or exc.task_id is None:
                    raise
                self._put(exc.task_id, exc)
                continue
            if event is NEED_DATA:
                return
            if event is CLOSED:
                raise ConnectionError("the server closed the connection")
            self._route(event)

    def _route(self, message: m.Message) -> None:
        if isinstance(message, m.Heartbeat):
            self.heartbeats += 1
        elif isinstance(message, m.ErrorMessage) and message.task_id is None:
            raise message.error.exception()
        elif isinstance(message, m.ProtocolInfo):
            self._put(None, message)
        else:
            self._put(message.task_id, message)  # type: ignore[union-attr]

    def _put(self, key: str | None, item: Any) -> None:
        queue = self._queues.get(key)
        if queue is not None:
            queue.put_nowait(item)

    def _fail(self, exc: BaseException) -> None:
        if self._failure is not None:
            return
        self._failure = exc
        for queue in self._queues.values():
            queue.put_nowait(exc)

    def _task_id(self, wanted: str | None) -> str:
        """``wanted`` if it is free, else ValueError; None: a fresh ``t<n>``."""
        if wanted is not None:
            if self._is_taken(wanted):
                raise ValueError(f"task {wanted!r} is already in flight on this connection")
            return wanted
        while True:
            candidate = f"t{next(self._ids)}"
            if not self._is_taken(candidate):
                return candidate

    def _is_taken(self, task_id: str) -> bool:
        return task_id in self._queues or task_id in self._conn.in_flight

    def _open(self, message: m.TaskStart | m.InferRequest) -> str:
        """Send a task's first message and give the task a queue."""
        self._send(message)
        self._queues[message.task_id] = self._new_queue()
        return message.task_id

    def _open_infer(self, task_id: str | None, stream: bool, request: dict[str, Any]) -> str:
        return self._open(m.InferRequest(self._task_id(task_id), **request, stream=stream))

    def _open_start(self, task_id: str | None, session_id: str, model: str, tools: Any) -> str:
        return self._open(m.TaskStart(self._task_id(task_id), session_id, model, tools))


class _Stream:
    """One INFER_REQUEST's replies: ``tokens`` so far, and ``completion`` once the task has completed."""

    def __init__(self, client: _ClientCore, task_id: str) -> None:
        self._client = client
        self.task_id = task_id
        self.tokens: list[m.StreamToken] = []
        self.completion: Completion | None = None
        self._done = False

    def _take(self, message: m.Message) -> m.StreamToken | None:
        """``message`` if it is a token; else the task is over: None with ``completion`` set, or its error raised."""
        if isinstance(message, m.StreamToken):
            self.tokens.append(message)
            return message
        self._done = True
        self._client._queues.pop(self.task_id, None)
        done = _expect(message, m.TaskComplete)
        self.completion = Completion(done.task_id, done.text, done.usage, done.timings, done.stop_reason,
                                     done.tool_call, done.stats, tuple(self.tokens))
        return None

    def _abandon_if_refused(self, exc: BaseException) -> None:
        """After a non-fatal protocol error about this task alone (the server broke the conversation rules for it):
        abandon the task as :meth:`close` does; the connection goes on."""
        if isinstance(exc, RemoteProtocolError) and not exc.fatal and exc.task_id == self.task_id:
            self.close()

    def close(self) -> None:
        """Abandon the task: send CANCEL if it is still running and drop whatever arrives for it."""
        if self._done:
            return
        self._done = True
        self._client._queues.pop(self.task_id, None)
        with contextlib.suppress(Exception):
            self._client._send(m.Cancel(self.task_id))


class _Inbox(collections.deque[Any]):
    """A task's queue in the blocking client: a deque with ``asyncio.Queue``'s ``put_nowait``."""

    def put_nowait(self, item: Any) -> None:
        self.append(item)


def _timeval(seconds: float | None) -> bytes:
    """A ``struct timeval`` for SO_RCVTIMEO/SO_SNDTIMEO; None: no limit (0 is no limit too, so a limit is >= 1 us)."""
    micro = 0 if seconds is None else max(1, math.ceil(seconds * 1e6))
    return struct.pack("@ll", *divmod(micro, 1_000_000))


class TokenStream(_Stream):
    """Iterate it for one task's ``StreamToken`` messages; once it is exhausted, ``completion`` is set. Each
    ``next()`` is one call under the client's ``timeout``. ``close()`` cancels the task if it is unfinished."""

    _client: MagnClient

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> m.StreamToken:
        token = self._pull(self._client._deadline())
        if token is None:
            raise StopIteration
        return token

    def _pull(self, deadline: float | None) -> m.StreamToken | None:
        if self._done:
            return None
        try:
            message = self._client._next(self.task_id, deadline)
        except TimeoutError:  # the caller gave up: stop the generation too
            self.close()
            raise
        except RemoteProtocolError as exc:
            self._abandon_if_refused(exc)
            raise
        return self._take(message)


class MagnClient(_ClientCore):
    """Blocking MAGN client on one connection: ``with MagnClient(path, timeout=30) as client: ...`` (not
    thread-safe). ``timeout`` (seconds; None: no limit) bounds each call (connecting, ``infer``, one ``next()`` of a
    stream...): one that runs out raises ``TimeoutError`` and cancels its task; the connection goes on.

    It owns its socket (and the kernel send/receive time limits set on it) on top of what :class:`_ClientCore` owns;
    the calls read the socket themselves, so no thread runs behind it.
    """

    def __init__(self, path: str, *, timeout: float | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        super().__init__(path, max_frame_bytes)
        self.timeout = timeout
        self.closed = False
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(self.path)
            self._sock.settimeout(None)  # blocking; limits are the kernel's SO_RCVTIMEO/SO_SNDTIMEO (see _recv)
        except BaseException:
            self._sock.close()
            raise
        self._rcvtimeo = False  # whether SO_RCVTIMEO is set to a limit now
        self._sndtimeo: float | None = None  # the SO_SNDTIMEO set now

    def __enter__(self) -> MagnClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (again: nothing); later calls raise ``ConnectionError``."""
        if self.closed:
            return
        self.closed = True
        self._failure = None
        for queue in self._queues.values():
            queue.clear()
        self._fail(ConnectionError("the client is closed"))
        self._sock.close()

    def _new_queue(self) -> _Inbox:
        return _Inbox()

    def _deadline(self) -> float | None:
        if self.timeout is None:
            return None
        return time.monotonic() + self.timeout

    def _write(self, data: bytes) -> None:
        try:
            if self._sndtimeo != self.timeout:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, _timeval(self.timeout))
                self._sndtimeo = self.timeout
            self._sock.sendall(data)
        except OSError as exc:  # a part of a frame may be out: the connection is lost
            with contextlib.suppress(TimeoutError):  # but what the server said first (TOO_MANY_CONNECTIONS...) wins
                while self._failure is None:
                    self._receive(time.monotonic() + DRAIN_S)
            self._fail(ConnectionError(f"send failed: {exc}"))
            assert self._failure is not None
            raise self._failure from exc

    def _receive(self, deadline: float | None) -> None:
        """Read once from the socket and route what it completes; any error but a timeout fails the connection."""
        try:
            self._feed(self._recv(deadline))
        except TimeoutError:
            raise
        except Exception as exc:  # ApplianceError, ProtocolError, OSError: whatever it is, every waiter gets it
            self._fail(exc)

    def _recv(self, deadline: float | None) -> bytes:
        """One ``recv`` that sleeps in the kernel, under SO_RCVTIMEO: the first token of a stream reaches a caller
        blocked in ``recv`` about 1 ms sooner than one woken by ``poll`` (what ``settimeout`` does)."""
        while True:
            if deadline is not None or self._rcvtimeo:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("the call timed out")
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(left))
                self._rcvtimeo = left is not None
            try:
                return self._sock.recv(RECV_BYTES)
            except BlockingIOError:  # the kernel's limit ran out: the loop sees whether ours did
                continue

    def _next(self, key: str | None, deadline: float | None) -> m.Message:
        """The next message queued for ``key``, reading the socket until there is one."""
        queue = self._queues[key]
        while not queue:
            self._receive(deadline)
        if isinstance(queue[0], BaseException):
            raise queue[0]  # it stays there for whoever waits next
        return queue.popleft()  # type: ignore[no-any-return]

    def protocol_info(self) -> m.ProtocolInfo:
        deadline = self._deadline()
        self._send(m.ProtocolInfoRequest())
        return _expect(self._next(None, deadline), m.ProtocolInfo)

    def start_task(self, session_id: str, model: str, *, tools: Any = None, task_id: str | None = None) -> m.TaskStart:
        """Open an agent session; returns the server's TASK_START echo (with ``status``)."""
        deadline = self._deadline()
        task_id = self._open_start(task_id, session_id, model, tools)
        try:
            return _expect(self._next(task_id, deadline), m.TaskStart)
        finally:
            self._queues.pop(task_id, None)

    def stream(self, *, task_id: str | None = None, **request: Any) -> TokenStream:
        """Send a streaming INFER_REQUEST now; iterate the result for its tokens."""
        return TokenStream(self, self._open_infer(task_id, True, request))

    def infer(self, *, stream: bool = False, task_id: str | None = None, **request: Any) -> Completion:
        """Run one INFER_REQUEST to completion (with ``stream``, the tokens are kept in the result)."""
        deadline = self._deadline()
        tokens = TokenStream(self, self._open_infer(task_id, stream, request))
        while tokens._pull(deadline) is not None:
            pass
        assert tokens.completion is not None
        return tokens.completion

    def cancel(self, task_id: str) -> None:
        """Ask the server to stop ``task_id``; its waiter then gets ``ApplianceError`` CANCELLED."""
        self._send(m.Cancel(task_id))
