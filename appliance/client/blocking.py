"""The blocking MAGN client :class:`MagnClient`, and what it shares with the asyncio one (import both from
:mod:`appliance.client.aio`): a queue per task in flight (key ``task_id``; ``None`` for PROTOCOL_INFO), the routing of
received messages to them, the building of requests and of each task's :class:`Completion`.

:class:`MagnClient` is a plain blocking socket: a call writes its frame with one ``sendall``, then reads the socket
itself (large ``recv`` chunks into a :class:`~appliance.protocol.frames.FrameParser`) until its own task's next message is
queued; what arrives meanwhile for other tasks in flight (a stream left open, say) waits in their queues.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import math
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from appliance.protocol import messages as m
from appliance.protocol.frames import CLOSED, DEFAULT_MAX_FRAME_BYTES, Frame, FrameParser, RemoteProtocolError

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


def _expect(msg: m.Message, cls: type[_T]) -> _T:
    if isinstance(msg, cls):  # else raise the task's error (ERROR) or an unexpected-message protocol error
        return msg
    if isinstance(msg, m.ErrorMessage):
        raise msg.error.exception()
    raise RemoteProtocolError("BAD_PAYLOAD", f"unexpected {msg.TYPE} for this task", fatal=False,
                              details={"field": "type", "reason": "unexpected message", "type": msg.TYPE})


class _Connection:
    """Both clients' bookkeeping. A subclass sets ``_Queue`` (a queue type with ``put_nowait``) and ``_write``.

    A failure (:meth:`_fail`) is put at the end of every queue, where it stays: the waiters get what was queued
    before it, then the failure, again and again; no task can be opened after it."""

    _Queue: Callable[[], Any]

    def __init__(self, path: str, max_frame_bytes: int) -> None:
        self.path, self.max_frame_bytes = str(path), max_frame_bytes
        self.heartbeats = 0  # HEARTBEAT messages received on this connection
        self._queues: dict[str | None, Any] = {None: self._Queue()}
        self._failure: BaseException | None = None
        self._ids = itertools.count(1)

    def _write(self, data: bytes) -> None:
        raise NotImplementedError

    def _send(self, message: m.Message) -> None:
        if self._failure is not None:
            raise self._failure
        self._write(m.encode_message(message))

    def _route(self, msg: m.Message) -> None:
        if isinstance(msg, m.Heartbeat):
            self.heartbeats += 1
        elif isinstance(msg, m.ErrorMessage) and msg.task_id is None:
            raise msg.error.exception()
        elif isinstance(msg, m.ProtocolInfo):
            self._queues[None].put_nowait(msg)
        elif not isinstance(msg, m.ProtocolInfoRequest) and msg.task_id in self._queues:
            self._queues[msg.task_id].put_nowait(msg)

    def _fail(self, exc: BaseException) -> None:
        if self._failure is None:
            self._failure = exc
            for queue in self._queues.values():
                queue.put_nowait(exc)

    def _open(self, task_id: str | None, build: Callable[[str], m.Message]) -> str:  # send a task's first message
        task_id = task_id or next(t for n in self._ids if (t := f"t{n}") not in self._queues)
        if task_id in self._queues:
            raise ValueError(f"task {task_id!r} is already in flight on this connection")
        self._send(build(task_id))
        self._queues[task_id] = self._Queue()
        return task_id

    def _open_infer(self, task_id: str | None, stream: bool, request: dict[str, Any]) -> str:
        return self._open(task_id, lambda t: m.InferRequest(t, **request, stream=stream))

    def _open_start(self, task_id: str | None, session_id: str, model: str, tools: Any) -> str:
        return self._open(task_id, lambda t: m.TaskStart(t, session_id, model, tools))


class _Stream:
    """One INFER_REQUEST's replies: ``tokens`` so far, and ``completion`` once the task has completed."""

    def __init__(self, client: _Connection, task_id: str) -> None:
        self._client, self.task_id = client, task_id
        self.tokens: list[m.StreamToken] = []
        self.completion: Completion | None = None
        self._done = False

    def _take(self, msg: m.Message) -> m.StreamToken | None:
        """``msg`` if it is a token; else the task is over: None with ``completion`` set, or its error raised."""
        if isinstance(msg, m.StreamToken):
            self.tokens.append(msg)
            return msg
        self._done = True
        self._client._queues.pop(self.task_id, None)
        done = _expect(msg, m.TaskComplete)
        self.completion = Completion(done.task_id, done.text, done.usage, done.timings, done.stop_reason,
                                     done.tool_call, done.stats, tuple(self.tokens))
        return None

    def close(self) -> None:
        """Abandon the task: send CANCEL if it is still running and drop whatever arrives for it."""
        if not self._done:
            self._done = True
            self._client._queues.pop(self.task_id, None)
            with contextlib.suppress(Exception):
                self._client._send(m.Cancel(self.task_id))


class _Inbox(collections.deque[Any]):  # a task's queue in the blocking client
    put_nowait = collections.deque.append


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
        if (token := self._pull(self._client._deadline())) is None:
            raise StopIteration
        return token

    def _pull(self, deadline: float | None) -> m.StreamToken | None:
        if self._done:
            return None
        try:
            msg = self._client._next(self.task_id, deadline)
        except TimeoutError:  # the caller gave up: stop the generation too
            self.close()
            raise
        return self._take(msg)


class MagnClient(_Connection):
    """Blocking MAGN client on one connection: ``with MagnClient(path, timeout=30) as client: ...`` (not
    thread-safe). ``timeout`` (seconds; None: no limit) bounds each call (connecting, ``infer``, one ``next()`` of a
    stream...): one that runs out raises ``TimeoutError`` and cancels its task; the connection goes on."""

    _Queue = _Inbox

    def __init__(self, path: str, *, timeout: float | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        super().__init__(path, max_frame_bytes)
        self.timeout, self.closed = timeout, False
        self._parser = FrameParser(max_frame_bytes)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(self.path)
            self._sock.settimeout(None)  # blocking; limits are the kernel's SO_RCVTIMEO/SO_SNDTIMEO (see _recv)
        except BaseException:
            self._sock.close()
            raise
        self._rcvtimeo, self._sndtimeo = False, None  # what is set on the socket now

    def __enter__(self) -> MagnClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection (again: nothing); later calls raise ``ConnectionError``."""
        if not self.closed:
            self.closed, self._failure = True, None
            for queue in self._queues.values():
                queue.clear()
            self._fail(ConnectionError("the client is closed"))
            self._sock.close()

    def _deadline(self) -> float | None:
        return None if self.timeout is None else time.monotonic() + self.timeout

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
        """Read once from the socket and route every complete frame; any error but a timeout fails the connection."""
        try:
            self._parser.receive_data(self._recv(deadline))
            while isinstance(event := self._parser.next_event(), Frame):
                self._route(m.parse_message(event.payload))
            if event is CLOSED:
                raise ConnectionError("the server closed the connection")
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
            with contextlib.suppress(BlockingIOError):  # the kernel's limit ran out: the loop sees whether ours did
                return self._sock.recv(RECV_BYTES)

    def _next(self, key: str | None, deadline: float | None) -> m.Message:
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
