"""A MAGN client over a Unix socket: :class:`AsyncMagnClient` (asyncio) and :class:`MagnClient` (blocking).

A reader task routes each message to the queue of its ``task_id``, so calls may run concurrently and streams may
interleave on one connection. A task's ERROR raises its :class:`~appliance.errors.ApplianceError` in the call that
waits for it; HEARTBEATs are only counted (``client.heartbeats``). An ERROR with a null ``task_id``, a protocol error
in what the server sent, or the end of the connection fails every waiting and later call with that error (what was
received before it is still delivered). Messages for tasks nobody waits for are dropped. Cancelling the coroutine
that waits for a task, or closing its stream early, sends CANCEL. ``infer``/``stream`` take ``InferRequest`` fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

from appliance import messages as m
from appliance.frames import CLOSED, DEFAULT_MAX_FRAME_BYTES, Frame, FrameParser, RemoteProtocolError

_T = TypeVar("_T")


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


class AsyncTokenStream:
    """Async iterator of one task's ``StreamToken`` messages; once it is exhausted, ``completion`` is set."""

    def __init__(self, client: AsyncMagnClient, task_id: str) -> None:
        self._client, self.task_id = client, task_id
        self.tokens: list[m.StreamToken] = []
        self.completion: Completion | None = None
        self._done = False

    def __aiter__(self) -> AsyncTokenStream:
        return self

    async def __anext__(self) -> m.StreamToken:
        if self._done:
            raise StopAsyncIteration
        try:
            msg = await self._client._next(self.task_id)
        except asyncio.CancelledError:  # the caller gave up: stop the generation too
            self.close()
            raise
        if isinstance(msg, m.StreamToken):
            self.tokens.append(msg)
            return msg
        self._done = True
        self._client._queues.pop(self.task_id, None)
        done = _expect(msg, m.TaskComplete)
        self.completion = Completion(done.task_id, done.text, done.usage, done.timings, done.stop_reason,
                                     done.tool_call, done.stats, tuple(self.tokens))
        raise StopAsyncIteration

    def close(self) -> None:
        """Abandon the task: send CANCEL if it is still running and drop whatever arrives for it."""
        if not self._done:
            self._done = True
            self._client._queues.pop(self.task_id, None)
            with contextlib.suppress(Exception):
                self._client._send(m.Cancel(self.task_id))


class AsyncMagnClient:
    """asyncio MAGN client: ``async with AsyncMagnClient(path) as client: ...``."""

    def __init__(self, path: str, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.path, self.max_frame_bytes = str(path), max_frame_bytes
        self.heartbeats = 0  # HEARTBEAT messages received on this connection
        self._queues: dict[str | None, asyncio.Queue[m.Message | BaseException]] = {None: asyncio.Queue()}
        self._failure: BaseException | None = None
        self._ids = itertools.count(1)
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._sock: socket.socket | None = None
        self._tasks: list[asyncio.Task[None]] = []

    async def connect(self) -> AsyncMagnClient:
        loop, sock = asyncio.get_running_loop(), socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, self.path)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        self._tasks = [asyncio.create_task(loop_(loop, sock)) for loop_ in (self._read_loop, self._write_loop)]
        return self

    async def __aenter__(self) -> AsyncMagnClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._flush()
        self._fail(ConnectionError("the client is closed"))
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()

    async def _read_loop(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        parser = FrameParser(self.max_frame_bytes)
        try:
            while True:
                parser.receive_data(await loop.sock_recv(sock, 65536))
                while isinstance(event := parser.next_event(), Frame):
                    self._route(m.parse_message(event.payload))
                if event is CLOSED:
                    raise ConnectionError("the server closed the connection")
        except Exception as exc:  # ApplianceError, ProtocolError, OSError: whatever it is, the waiters get it
            self._fail(exc)

    async def _write_loop(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        try:
            while True:
                await loop.sock_sendall(sock, await self._outbox.get())
                self._outbox.task_done()
        except OSError as exc:  # the reader still delivers what the server said first (e.g. TOO_MANY_CONNECTIONS)
            await asyncio.wait(self._tasks[:1], timeout=1)
            self._fail(ConnectionError(f"send failed: {exc}"))

    async def _flush(self) -> None:  # wait (a second at most) until all queued is written, unless the writer died
        if self._tasks and not self._tasks[1].done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._outbox.join(), 1)

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

    def _send(self, message: m.Message) -> None:
        if self._failure is not None:
            raise self._failure
        if self._sock is None:
            raise ConnectionError("not connected: call connect() first")
        self._outbox.put_nowait(m.encode_message(message))

    def _open(self, task_id: str | None, build: Callable[[str], m.Message]) -> str:  # send a task's first message
        task_id = task_id or next(t for n in self._ids if (t := f"t{n}") not in self._queues)
        if task_id in self._queues:
            raise ValueError(f"task {task_id!r} is already in flight on this connection")
        self._send(build(task_id))
        self._queues[task_id] = asyncio.Queue()
        return task_id

    async def _next(self, key: str | None) -> m.Message:
        queue = self._queues[key]
        item = await queue.get()
        if isinstance(item, BaseException):
            queue.put_nowait(item)  # for whoever waits next
            raise item
        return item

    async def protocol_info(self) -> m.ProtocolInfo:
        self._send(m.ProtocolInfoRequest())
        return _expect(await self._next(None), m.ProtocolInfo)

    async def start_task(self, session_id: str, model: str, *, tools: Any = None,
                         task_id: str | None = None) -> m.TaskStart:
        """Open an agent session; returns the server's TASK_START echo (with ``status``)."""
        task_id = self._open(task_id, lambda t: m.TaskStart(t, session_id, model, tools))
        try:
            return _expect(await self._next(task_id), m.TaskStart)
        finally:
            self._queues.pop(task_id, None)

    def stream(self, *, task_id: str | None = None, **request: Any) -> AsyncTokenStream:
        """Send a streaming INFER_REQUEST now; ``async for`` the result for its tokens."""
        return AsyncTokenStream(self, self._open(task_id, lambda t: m.InferRequest(t, **request, stream=True)))

    async def infer(self, *, stream: bool = False, task_id: str | None = None, **request: Any) -> Completion:
        """Run one INFER_REQUEST to completion (with ``stream``, the tokens are kept in the result)."""
        tokens = AsyncTokenStream(self, self._open(task_id, lambda t: m.InferRequest(t, **request, stream=stream)))
        async for _ in tokens:
            pass
        assert tokens.completion is not None
        return tokens.completion

    async def cancel(self, task_id: str) -> None:
        """Ask the server to stop ``task_id``; its waiter then gets ``ApplianceError`` CANCELLED."""
        self._send(m.Cancel(task_id))
        await self._flush()


class TokenStream(AsyncTokenStream):
    """The blocking twin of :class:`AsyncTokenStream`: iterate it for tokens; then ``completion`` is set."""

    def __init__(self, client: MagnClient, task_id: str) -> None:
        super().__init__(client._client, task_id)
        self._blocking = client

    def __iter__(self) -> TokenStream:
        return self

    def __next__(self) -> m.StreamToken:
        try:
            return self._blocking._run(self.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        super().close()
        self._blocking._run(self._client._flush())


class MagnClient:
    """:class:`AsyncMagnClient`'s methods on a private ``asyncio.Runner`` (not thread-safe; not for a running loop).
    ``timeout`` bounds each call: one that times out raises ``TimeoutError`` and cancels its task."""

    def __init__(self, path: str, *, timeout: float | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        self.timeout, self.closed = timeout, False
        self._runner = asyncio.Runner()
        self._client = AsyncMagnClient(path, max_frame_bytes=max_frame_bytes)
        try:
            self._run(self._client.connect())
        except BaseException:
            self._runner.close()
            raise

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        if self.closed:
            coro.close()
            raise ConnectionError("the client is closed")
        return self._runner.get_loop().run_until_complete(self._bounded(coro))

    async def _bounded(self, coro: Coroutine[Any, Any, _T]) -> _T:
        if self.timeout is None:
            return await coro
        async with asyncio.timeout(self.timeout):
            return await coro

    @property
    def heartbeats(self) -> int:  # HEARTBEAT messages received on this connection
        return self._client.heartbeats

    def close(self) -> None:
        if not self.closed:
            try:
                self._run(self._client.close())
            finally:
                self.closed = True
                self._runner.close()

    def __enter__(self) -> MagnClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def protocol_info(self) -> m.ProtocolInfo:
        return self._run(self._client.protocol_info())

    def start_task(self, session_id: str, model: str, *, tools: Any = None, task_id: str | None = None) -> m.TaskStart:
        return self._run(self._client.start_task(session_id, model, tools=tools, task_id=task_id))

    def stream(self, *, task_id: str | None = None, **request: Any) -> TokenStream:
        stream = TokenStream(self, self._client._open(task_id, lambda t: m.InferRequest(t, **request, stream=True)))
        self._run(self._client._flush())
        return stream

    def infer(self, *, stream: bool = False, task_id: str | None = None, **request: Any) -> Completion:
        return self._run(self._client.infer(stream=stream, task_id=task_id, **request))

    def cancel(self, task_id: str) -> None:
        self._run(self._client.cancel(task_id))
