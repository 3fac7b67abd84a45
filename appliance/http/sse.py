"""Server-sent events on the wire: what a generation has ready goes out in one write.

A stream's events come from a queue its generation fills on the event loop (one item per delivery of tokens: every
token of an engine step, a heartbeat, the end). :func:`ready` takes every item queued at a wake-up, so that the
events they make are joined into one body message (one HTTP chunk, one socket write) rather than one write each;
:class:`EventStream` is the ASGI response that writes those bodies, and watches the connection with one task (a
client that leaves calls ``on_disconnect``: the generation is cancelled and its stream ends).

While a stream waits for its next tokens (everything before was written), :class:`TokenWrites` writes them without
waking it: each token by the engine thread itself where the connection can take it now, else a delivery by the
run's sink on the loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from appliance.http import chunkwrite

if TYPE_CHECKING:
    from appliance.engine.interface import Token
    from appliance.server.pump import TokenPump

HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
"""An event stream's headers: no cache, and no buffering by a proxy in front (nginx)."""


def ready(queue: asyncio.Queue[Any], first: Any) -> list[Any]:
    """``first`` and every item queued behind it now, in order (nothing is awaited)."""
    items = [first]
    while not queue.empty():
        items.append(queue.get_nowait())
    return items


async def deliveries(queue: asyncio.Queue[Any], first: Any, end: object,
                     parked: Callable[[bool], None] | None = None) -> AsyncIterator[tuple[list[Any], bool]]:
    """The items of a stream's ``queue`` from ``first`` (already taken) up to ``end`` (left out), in lists of what
    was queued together (:func:`ready`: one write's worth each), each with whether it is the last (``end`` came
    with it: the stream's end can go in the same write). ``parked(True)`` is called as it starts waiting for the
    next item (everything before was handed out and written), ``parked(False)`` as it wakes."""
    items = ready(queue, first)
    while end not in items:
        yield items, False
        if parked is not None:
            parked(True)
        try:
            item = await queue.get()
        finally:
            if parked is not None:
                parked(False)
        items = ready(queue, item)
    yield items[:items.index(end)], True


class Streamed(Protocol):
    """What :class:`TokenWrites` uses of a streamed run (:class:`~appliance.http.openai.Run`)."""

    queue: asyncio.Queue[Any]
    direct: Callable[[list[Token]], bool] | None
    pump: TokenPump | None


class TokenWrites:
    """The tokens of ``run``'s stream written while the stream waits for them (nothing queued, nothing being
    written), without waking its generator: the same bytes, in the same order. ``render`` turns tokens into the
    stream's bytes and keeps the stream's state (reasoning split, tool-call parser, log-probabilities): whoever
    calls it, the generator or one of the two ways below, is the only one at that moment.

    * :meth:`on_engine`, the run's pump's writer: each token rendered and written by the engine thread itself
      (:meth:`~appliance.http.chunkwrite.ChunkWriter.write_now`), when the connection has nothing to write before
      it: no wake-up of the loop for it;
    * :meth:`on_loop`, the run's sink's direct way: a delivery of tokens the engine thread left to the loop (the
      connection had bytes to drain) rendered and written by the sink; one the connection cannot take now is queued
      as its rendered bytes, for the generator to write through ``send``.

    The generator passes :meth:`parked` to :func:`deliveries` and calls ``parked(False)`` when it ends."""

    def __init__(self, run: Streamed, render: Callable[[Sequence[Token]], bytes],
                 chunks: chunkwrite.ChunkWriter | None) -> None:
        self.run = run
        self.render = render
        self.chunks = chunks

    def on_loop(self, tokens: list[Token]) -> bool:
        """The loop: write ``tokens`` now, or queue their bytes; False when the stream must take them itself
        (something is queued before them: in order)."""
        if self.chunks is None or not self.run.queue.empty():
            return False
        data = self.render(tokens)
        if data and not self.chunks.write(data):
            self.run.queue.put_nowait(data)  # rendered: written through send, after what was written before
        return True

    def on_engine(self, token: Token) -> bool:
        """The engine thread: write ``token`` now; False (nothing rendered) when it must go the loop's way."""
        if self.chunks is None or not self.run.queue.empty():
            return False

        def rendered() -> bytes:
            return self.render([token])

        return self.chunks.write_now(rendered)

    def parked(self, waiting: bool) -> None:
        """The stream starts waiting for its next item (``True``: the two ways are open) or wakes (closed)."""
        run = self.run
        run.direct = self.on_loop if waiting else None
        if run.pump is not None:
            run.pump.writer = self.on_engine if waiting else None


async def watch_disconnect(receive: Receive, on_disconnect: Callable[[], None]) -> None:
    """Call ``on_disconnect`` when the client disconnects (the request body has been read: the next ASGI message
    is the disconnect)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            on_disconnect()
            return


class EventStream(Response):
    """An SSE response: each bytes object ``body`` yields is one body message (the events of one write), then the
    end of the body. While it is written, one task watches the connection: a client that leaves calls
    ``on_disconnect`` (the body is expected to end soon after: its generation is cancelled). Where the server gave
    the request a :class:`~appliance.http.chunkwrite.ChunkWriter`, a body message goes out through it (straight to
    the connection, the same bytes) whenever it can."""

    media_type = "text/event-stream"

    def __init__(self, body: AsyncIterable[bytes], on_disconnect: Callable[[], None]) -> None:
        self.body_iterator = body
        self.on_disconnect = on_disconnect
        self.status_code = 200
        self.background = None
        self.init_headers(HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        watcher = asyncio.create_task(watch_disconnect(receive, self.on_disconnect))
        chunks = chunkwrite.writer_of(scope)
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for data in self.body_iterator:
                if chunks is None or not data or not chunks.write(data):
                    await send({"type": "http.response.body", "body": data, "more_body": True})
        finally:
            watcher.cancel()
        await send({"type": "http.response.body", "body": b"", "more_body": False})
