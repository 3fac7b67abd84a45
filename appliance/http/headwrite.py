"""The writes of one HTTP response: its head waits for its body; a stream's chunks may come from another thread.

uvicorn writes a response's head (status line and headers) and its body with one ``transport.write`` each: two
``send`` calls, two TCP segments (the server's sockets are ``TCP_NODELAY``) and two wake-ups of the client for a
reply that fits in one. :class:`HeldHeadTransport` stands between one request's response and the connection's
transport: the first write of the response is held, and goes out joined with the next write made in the same
event-loop step (a plain response writes its body right after its head), or alone at that step's end (a stream
whose first event is not ready yet, a ``100 Continue``): nothing waits longer than the step that wrote it.

A stream's tokens come from the engine thread; handing each to the loop costs a wake-up and a loop iteration per
token (a few hundred microseconds of CPU on a small box, beside the decode). :meth:`HeldHeadTransport.write_now`
lets that thread write them itself. asyncio's transport is not thread-safe, so such a write goes straight to the
socket, and only when its bytes are the next the connection sends (the head went out, nothing is held, the
transport's buffer is empty). Every write of the connection's, from either thread, holds its :class:`Wire`'s lock; a
write the socket takes only part of leaves the rest held, for the loop to write before anything after it. The
protocol closes the wire (under the lock) before asyncio closes the socket: no thread writes to a file descriptor
that was closed, or reused since.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Callable


class Wire:
    """A connection's socket as writers on any thread see it: the lock every write takes, its file descriptor, and
    whether it is still open (:meth:`close`, from the protocol's ``connection_lost``)."""

    __slots__ = ("lock", "fd", "open")

    def __init__(self, fd: int | None) -> None:
        self.lock = threading.RLock()  # a loop-side write inside another (a flush from a write) must not deadlock
        self.fd = -1 if fd is None else fd
        self.open = fd is not None

    @classmethod
    def of(cls, transport: asyncio.BaseTransport) -> Wire:
        """The wire of ``transport``'s socket; one no thread may write to (closed) where bytes written to the
        socket would not be the transport's (TLS) or there is no socket."""
        sock = transport.get_extra_info("socket")
        if sock is None or transport.get_extra_info("sslcontext") is not None:
            return cls(None)
        return cls(sock.fileno())

    def close(self) -> None:
        """No thread writes to the socket from now on (waits for a write in progress)."""
        with self.lock:
            self.open = False


class HeldHeadTransport:
    """The writes of one response (see the module docstring); ``transport``: the connection's, ``wire``: its
    socket's (a wire of its own when none is given)."""

    __slots__ = ("transport", "loop", "wire", "held", "first")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop,
                 wire: Wire | None = None) -> None:
        self.transport = transport
        self.loop = loop
        self.wire = Wire.of(transport) if wire is None else wire
        self.held: bytes | None = None
        self.first = True

    def write(self, data: bytes) -> None:
        with self.wire.lock:
            if self.first:
                self.first = False
                self.held = data
                self.loop.call_soon(self.flush)
                return
            held = self.held
            if held is not None:
                self.held = None
                data = held + data
            self.transport.write(data)

    def flush(self) -> None:
        """Write the held bytes, if they still wait (the end of the step that wrote the head; what the socket did
        not take of a :meth:`write_now`)."""
        with self.wire.lock:
            held = self.held
            if held is not None:
                self.held = None
                if not self.transport.is_closing():
                    self.transport.write(held)

    def write_now(self, render: Callable[[], bytes | None]) -> bool:
        """Any thread: write what ``render()`` returns straight to the socket, when nothing is before it. False,
        with ``render`` not called, while the head has not gone out, bytes are held, the transport has a buffer to
        drain, is closing or its wire is closed; False too when ``render()`` returns None (it cannot be written
        now). ``render`` runs under the wire's lock: no other write of the connection comes between its check and
        its bytes. What the socket does not take now is held and written by the loop, before any later write; a
        socket that fails (the client is gone) drops the bytes, and the loop learns of it from the transport."""
        wire = self.wire
        with wire.lock:
            transport = self.transport
            if not wire.open or self.first or self.held is not None or transport.is_closing():
                return False
            if transport.get_write_buffer_size():
                return False
            data = render()
            if data is None:
                return False
            if not data:
                return True
            try:
                sent = os.write(wire.fd, data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                return True
            if sent < len(data):
                self.held = data[sent:]
                with contextlib.suppress(RuntimeError):  # the loop is closed: nobody will write it
                    self.loop.call_soon_threadsafe(self.flush)
            return True

    def close(self) -> None:
        with self.wire.lock:
            self.flush()
            self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()
