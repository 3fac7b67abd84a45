"""A streamed response's body chunks written straight to its connection.

uvicorn carries every ``http.response.body`` message through each middleware's ``send`` (four of them here) and
h11's writer before it reaches the socket: for an event stream that is once per engine step. A chunk of a chunked
HTTP/1.1 body is only ``<size in hex>\\r\\n<data>\\r\\n`` on the wire, and h11 keeps no state for it (its chunked writer
is stateless; no middleware reads a body message), so a :class:`ChunkWriter` writes it itself. It writes only while
that is all ``send`` would do: the response's head has gone out through ``send`` and its framing is chunked, the
client is still there, and the connection's write buffer is under its high-water mark (else ``send`` waits for it to
drain: the caller sends that chunk through ``send``). The head and the body's end always go through ``send``.

:meth:`ChunkWriter.write_now` is the same from another thread (the engine's, a stream's tokens): through
:meth:`~appliance.http.headwrite.HeldHeadTransport.write_now`, its checks made under the connection's write lock,
so that the body's end (h11 leaves ``SEND_BODY`` before uvicorn writes it) cannot come between them and the chunk.

:class:`~appliance.http.app.GuardedH11Protocol` puts one in each request's ASGI scope (:func:`writer_of` finds it);
:class:`~appliance.http.sse.EventStream` writes through it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import h11
from h11._writers import ChunkedWriter

SCOPE_KEY = "appliance.chunk_writer"
"""The key of a request's ``scope["extensions"]`` under which its :class:`ChunkWriter` is."""


def chunk(data: bytes) -> bytes:
    """``data`` as one chunk of a chunked body (``data`` not empty: an empty chunk ends the body)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


class Cycle(Protocol):
    """What a :class:`ChunkWriter` reads of uvicorn's h11 request-response cycle."""

    conn: h11.Connection
    transport: Any
    flow: Any
    disconnected: bool
    response_started: bool
    response_complete: bool


class ChunkWriter:
    """Writes body chunks of ``cycle``'s response (see the module docstring)."""

    __slots__ = ("cycle",)

    def __init__(self, cycle: Cycle) -> None:
        self.cycle = cycle

    def write(self, data: bytes) -> bool:
        """Write ``data`` (not empty) as one body chunk now; False when it must go through ``send`` instead."""
        if not self.writable():
            return False
        self.cycle.transport.write(chunk(data))
        return True

    def writable(self) -> bool:
        """Whether a chunk written now is all ``send`` would do (see the module docstring)."""
        cycle = self.cycle
        if cycle.disconnected or cycle.response_complete or not cycle.response_started or cycle.flow.write_paused:
            return False
        conn = cycle.conn
        return conn.our_state is h11.SEND_BODY and isinstance(conn._writer, ChunkedWriter)  # h11 has no accessor

    def write_now(self, render: Callable[[], bytes]) -> bool:
        """Any thread: write ``render()`` as one body chunk (nothing for empty bytes) straight to the socket, when
        nothing of the connection's is waiting to be written before it; False, with ``render`` not called, when it
        must go through the loop instead."""

        def framed() -> bytes | None:
            if not self.writable():
                return None
            data = render()
            return chunk(data) if data else b""

        return self.cycle.transport.write_now(framed)


def writer_of(scope: dict[str, Any]) -> ChunkWriter | None:
    """The request's :class:`ChunkWriter`; None when its server put none in its scope."""
    extensions = scope.get("extensions")
    if extensions is None:
        return None
    return extensions.get(SCOPE_KEY)
