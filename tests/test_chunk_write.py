"""A streamed body's chunks written straight to the connection (:mod:`appliance.http.chunkwrite`): the bytes h11
would write, and only while ``send`` would do no more than write them (uvicorn's own h11 request-response cycle on
a recording transport); and an OpenAI stream's tokens written by its run's sink while the stream waits for them,
in order with everything else it writes."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from typing import Any

import h11
import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import RequestResponseCycle

from appliance.engine.interface import Token
from appliance.errors import ApplianceError
from appliance.http import openai
from appliance.http.chunkwrite import SCOPE_KEY, ChunkWriter, chunk, writer_of


class Recorded:
    """A transport that keeps what is written."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return False

    def close(self) -> None:
        return None

    def pause_reading(self) -> None:
        return None

    def resume_reading(self) -> None:
        return None


def cycle_for(request: bytes) -> tuple[RequestResponseCycle, Recorded]:
    """uvicorn's cycle for ``request`` (already received), writing to a :class:`Recorded` transport."""
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(request)
    while conn.next_event() not in (h11.NEED_DATA, h11.PAUSED) and conn.their_state is not h11.DONE:
        pass
    transport = Recorded()
    scope: Any = {"type": "http", "method": request.split(b" ", 1)[0].decode(), "headers": [],
                  "http_version": "1.1"}
    cycle = RequestResponseCycle(scope=scope, conn=conn, transport=transport,  # type: ignore[arg-type]
                                 flow=FlowControl(transport), logger=logging.getLogger("test"),  # type: ignore[arg-type]
                                 access_logger=logging.getLogger("test"), access_log=False, default_headers=[],
                                 message_event=asyncio.Event(), on_response=lambda: None)
    return cycle, transport


POST_11 = b"POST /s HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n"
POST_10 = b"POST /s HTTP/1.0\r\nHost: a\r\nContent-Length: 0\r\n\r\n"
HEAD_11 = b"HEAD /s HTTP/1.1\r\nHost: a\r\n\r\n"
START = {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]}


def body(data: bytes, more: bool = True) -> dict[str, Any]:
    return {"type": "http.response.body", "body": data, "more_body": more}


@pytest.mark.parametrize("data", [b"x", b"data: [DONE]\n\n", b"\x00\r\n" * 7, b"y" * 4096, b"z" * 70000])
def test_a_chunk_is_the_bytes_h11_writes(data: bytes) -> None:
    cycle, transport = cycle_for(POST_11)
    asyncio.run(cycle.send(START))  # type: ignore[arg-type]
    asyncio.run(cycle.send(body(data)))  # type: ignore[arg-type]
    assert chunk(data) == transport.writes[-1]


def test_a_stream_written_directly_is_the_stream_send_writes() -> None:
    """The same messages through ``send`` and through the writer (its end through ``send``): the same bytes."""
    pieces = [b"data: a\n\n", b"data: bb\n\n", b"data: [DONE]\n\n"]
    sent, sent_writes = cycle_for(POST_11)
    direct, direct_writes = cycle_for(POST_11)
    writer = ChunkWriter(direct)

    async def both() -> None:
        await sent.send(START)  # type: ignore[arg-type]
        await direct.send(START)  # type: ignore[arg-type]
        for piece in pieces:
            await sent.send(body(piece))  # type: ignore[arg-type]
            assert writer.write(piece)
        await sent.send(body(b"", more=False))  # type: ignore[arg-type]
        await direct.send(body(b"", more=False))  # type: ignore[arg-type]

    asyncio.run(both())
    assert b"".join(direct_writes.writes) == b"".join(sent_writes.writes)
    assert direct.response_complete and direct.conn.our_state is h11.DONE


def test_the_writer_leaves_to_send_whatever_send_does_more_than_write() -> None:
    """Before the head, after the end, a client gone, a full write buffer, a body not chunked (HTTP/1.0, HEAD):
    False, nothing written."""
    def started(request: bytes) -> tuple[RequestResponseCycle, Recorded]:
        cycle, transport = cycle_for(request)
        asyncio.run(cycle.send(START))  # type: ignore[arg-type]
        return cycle, transport

    cases: dict[str, tuple[RequestResponseCycle, Recorded]] = {}
    cases["before the head"] = cycle_for(POST_11)
    cases["HTTP/1.0 (no chunks)"] = started(POST_10)
    cases["HEAD (no body)"] = started(HEAD_11)
    gone = cases["client gone"] = started(POST_11)
    gone[0].disconnected = True
    paused = cases["write buffer full"] = started(POST_11)
    paused[0].flow.pause_writing()
    ended = cases["after the end"] = started(POST_11)
    asyncio.run(ended[0].send(body(b"", more=False)))  # type: ignore[arg-type]
    for what, (cycle, transport) in cases.items():
        before = list(transport.writes)
        assert not ChunkWriter(cycle).write(b"data: x\n\n"), what
        assert transport.writes == before, what
    live, transport = started(POST_11)
    assert ChunkWriter(live).write(b"data: x\n\n") and transport.writes[-1] == b"9\r\ndata: x\n\n\r\n"


def test_the_writer_is_found_in_the_scope_where_the_server_put_one() -> None:
    cycle, _ = cycle_for(POST_11)
    writer = ChunkWriter(cycle)
    assert writer_of({"extensions": {SCOPE_KEY: writer}}) is writer
    assert writer_of({"extensions": {}}) is None
    assert writer_of({}) is None


# -- a stream's tokens written by its sink while the stream waits (appliance.http.openai.events) ---------------------


class Writes:
    """A :class:`ChunkWriter` stand-in: keeps what it wrote; ``open`` False: it cannot write now."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.open = True

    def write(self, data: bytes) -> bool:
        if self.open:
            self.chunks.append(data)
        return self.open


class StreamRun:
    """What :func:`~appliance.http.openai.events` and the run's sink use of a :class:`~appliance.http.openai.Run`."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.direct = None
        self.pump = None
        self.cancel = threading.Event()
        self.task: asyncio.Future[Any] = asyncio.get_running_loop().create_future()

    def sink(self, tokens: list[Token]) -> bool:
        return openai.Run._sink(self, tokens)  # type: ignore[arg-type]


def tokens(*texts: str) -> list[Token]:
    return [Token(index, text, index, 0.0) for index, text in enumerate(texts)]


def texts_of(data: bytes) -> list[str]:
    events = [block.removeprefix("data: ") for block in data.decode().split("\n\n") if block.startswith("data: {")]
    return [json.loads(event)["choices"][0]["text"] for event in events]


def test_tokens_that_come_while_the_stream_waits_are_written_by_the_sink_in_order() -> None:
    """Fails before the sink wrote: every delivery then woke the stream through its queue."""

    async def scenario() -> None:
        run = StreamRun()
        writes = Writes()
        stream = openai.events(run, tokens("a"), openai.CompletionShape("m", False, False), writes)  # type: ignore[arg-type]
        assert texts_of(await anext(stream)) == ["a"]  # the first write: the stream's own
        following = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        assert run.direct is not None  # waiting for the next delivery
        assert run.sink(tokens("b", "c")) and run.sink(tokens("d"))
        assert [texts_of(chunk) for chunk in writes.chunks] == [["bc"], ["d"]] and run.queue.empty()
        writes.open = False  # the connection cannot take it now: rendered, queued, written by the stream
        assert run.sink(tokens("e"))
        run.queue.put_nowait(openai.PING)
        assert run.sink(tokens("f"))  # behind the ping: queued as it is
        assert texts_of(await following) == ["e", "f"] and len(writes.chunks) == 2
        following = asyncio.ensure_future(anext(stream))
        await asyncio.sleep(0)
        writes.open = True
        assert run.sink(tokens("g"))
        assert texts_of(writes.chunks[-1]) == ["g"]
        run.task.set_exception(ApplianceError("CANCELLED", "the task was cancelled"))
        run.queue.put_nowait(openai.END)
        end = await following
        assert b'"CANCELLED"' in end and run.direct is None  # the end went through the stream: nothing after it
        assert run.sink(tokens("h")) and run.queue.get_nowait() == tokens("h")  # queued, never written
        await stream.aclose()

    asyncio.run(scenario())
