"""One socket write for a small HTTP response: its head waits for its body.

uvicorn writes a response's head (status line and headers) and its body with one ``transport.write`` each: two
``send`` calls, two TCP segments (the server's sockets are ``TCP_NODELAY``) and two wake-ups of the client for a
reply that fits in one. :class:`HeldHeadTransport` stands between one request's response and the connection's
transport: the first write of the response is held, and goes out joined with the next write made in the same
event-loop step (a plain response writes its body right after its head), or alone at that step's end (a stream
whose first event is not ready yet, a ``100 Continue``): nothing waits longer than the step that wrote it.
"""

from __future__ import annotations

import asyncio


class HeldHeadTransport:
    """The writes of one response (see the module docstring); ``transport``: the connection's."""

    __slots__ = ("transport", "loop", "held", "first")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self.loop = loop
        self.held: bytes | None = None
        self.first = True

    def write(self, data: bytes) -> None:
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
        """Write the held head, if it still waits (the end of the step that wrote it)."""
        held = self.held
        if held is not None:
            self.held = None
            if not self.transport.is_closing():
                self.transport.write(held)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()
