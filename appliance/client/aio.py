"""A MAGN client over a Unix socket: :class:`AsyncMagnClient` (asyncio) and :class:`MagnClient` (blocking; it lives in
:mod:`appliance.client.blocking`, with what both share, and is imported from here).

Each received message goes to the queue of its ``task_id``, so streams may interleave on one connection: in
``AsyncMagnClient`` a reader task routes them (and calls may run concurrently); in ``MagnClient`` the call that waits
reads the socket itself, and what arrives meanwhile for other tasks in flight waits in their queues. A task's ERROR
raises its :class:`~appliance.errors.ApplianceError` in the call that waits for it; HEARTBEATs are only counted
(``client.heartbeats``). An ERROR with a null ``task_id``, a protocol error in what the server sent that is not about
one task (a broken framing, say), or the end of the connection fails every waiting and later call with that error
(what was received before it is still delivered); a non-fatal protocol error about one task (a message that breaks
the conversation rules of :mod:`appliance.protocol.connection`) is raised to that task's waiter only. Messages for
tasks nobody waits for (finished, or whose stream was closed) are dropped. Cancelling the coroutine that
waits for a task, a ``MagnClient`` call running past its ``timeout`` (``TimeoutError``), or closing a stream early
sends CANCEL. ``infer``/``stream`` take ``InferRequest`` fields.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

from appliance.client.blocking import Completion, MagnClient, TokenStream, _ClientCore, _expect, _Stream
from appliance.protocol import messages as m
from appliance.protocol.frames import DEFAULT_MAX_FRAME_BYTES, RemoteProtocolError

__all__ = ["AsyncMagnClient", "AsyncTokenStream", "Completion", "MagnClient", "TokenStream"]


class AsyncTokenStream(_Stream):
    """Async iterator of one task's ``StreamToken`` messages; once it is exhausted, ``completion`` is set."""

    _client: AsyncMagnClient

    def __aiter__(self) -> AsyncTokenStream:
        return self

    async def __anext__(self) -> m.StreamToken:
        if self._done:
            raise StopAsyncIteration
        try:
            message = await self._client._next(self.task_id)
        except asyncio.CancelledError:  # the caller gave up: stop the generation too
            self.close()
            raise
        except RemoteProtocolError as exc:
            self._abandon_if_refused(exc)
            raise
        token = self._take(message)
        if token is None:
            raise StopAsyncIteration
        return token


class AsyncMagnClient(_ClientCore):
    """asyncio MAGN client: ``async with AsyncMagnClient(path) as client: ...``; calls may run concurrently.

    It owns, on top of what :class:`~appliance.client.blocking._ClientCore` owns, its non-blocking socket, the outbox
    of frames to write, and two tasks: a reader (it feeds what it reads to the routing) and a writer (it drains the
    outbox), both ended by :meth:`close`. A frame is written at once when nothing is queued before it and the socket
    takes it whole (a request: no wake-up of the writer); what the socket does not take goes to the outbox.
    """

    def __init__(self, path: str, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        super().__init__(path, max_frame_bytes)
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._sock: socket.socket | None = None
        self._tasks: list[asyncio.Task[None]] = []  # [reader, writer] once connected
        self._sending = False  # the writer holds a frame taken from the outbox (not yet all written)

    def _new_queue(self) -> asyncio.Queue[Any]:
        return asyncio.Queue()

    async def connect(self) -> AsyncMagnClient:
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await loop.sock_connect(sock, self.path)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        reader = asyncio.create_task(self._read_loop(loop, sock))
        writer = asyncio.create_task(self._write_loop(loop, sock))
        self._tasks = [reader, writer]
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
        try:
            while True:
                self._feed(await loop.sock_recv(sock, 65536))
        except Exception as exc:  # ApplianceError, ProtocolError, OSError: whatever it is, the waiters get it
            self._fail(exc)

    async def _write_loop(self, loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
        try:
            while True:
                data = await self._outbox.get()
                self._sending = True
                await loop.sock_sendall(sock, data)
                self._sending = False
                self._outbox.task_done()
        except OSError as exc:  # the reader still delivers what the server said first (e.g. TOO_MANY_CONNECTIONS)
            await asyncio.wait(self._tasks[:1], timeout=1)
            self._fail(ConnectionError(f"send failed: {exc}"))

    async def _flush(self) -> None:
        """Wait (a second at most) until everything queued is written, unless the writer died."""
        if self._tasks and not self._tasks[1].done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._outbox.join(), 1)

    def _write(self, data: bytes) -> None:
        if self._sock is None:
            raise ConnectionError("not connected: call connect() first")
        if not self._sending and self._outbox.empty() and self._tasks and not self._tasks[1].done():
            try:  # nothing queued before it: straight to the socket
                sent = self._sock.send(data)
            except OSError:  # full (EAGAIN), or broken: the writer sends it, or meets the error and fails the client
                sent = 0
            data = data[sent:]
            if not data:
                return
        self._outbox.put_nowait(data)

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
        task_id = self._open_start(task_id, session_id, model, tools)
        try:
            return _expect(await self._next(task_id), m.TaskStart)
        finally:
            self._queues.pop(task_id, None)

    def stream(self, *, task_id: str | None = None, **request: Any) -> AsyncTokenStream:
        """Send a streaming INFER_REQUEST now; ``async for`` the result for its tokens."""
        return AsyncTokenStream(self, self._open_infer(task_id, True, request))

    async def infer(self, *, stream: bool = False, task_id: str | None = None, **request: Any) -> Completion:
        """Run one INFER_REQUEST to completion (with ``stream``, the tokens are kept in the result)."""
        tokens = AsyncTokenStream(self, self._open_infer(task_id, stream, request))
        async for _ in tokens:
            pass
        assert tokens.completion is not None
        return tokens.completion

    async def cancel(self, task_id: str) -> None:
        """Ask the server to stop ``task_id``; its waiter then gets ``ApplianceError`` CANCELLED."""
        self._send(m.Cancel(task_id))
        await self._flush()
