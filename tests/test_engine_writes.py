"""A stream's tokens written by the engine thread (appliance/server/pump.py's writer,
appliance/http/headwrite.py's ``write_now``, appliance/http/chunkwrite.py's ``write_now``): the pump hands a token to
its writer only when nothing is queued before it, and the two ways keep the tokens' order; a thread writes to the
socket only when its bytes are the next the connection sends, what the socket does not take is written by the loop
before anything after it, and nothing is written once the wire is closed; against a real appliance, a completion
stream's tokens go out from the engine thread, the same text as the answer without a stream."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import h11
import httpx
import pytest
from harness import Running, running
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import RequestResponseCycle

from appliance.engine.interface import Token
from appliance.http import headwrite
from appliance.http.chunkwrite import ChunkWriter
from appliance.http.headwrite import HeldHeadTransport, Wire
from appliance.server.pump import TokenPump

HEAD = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"


def token(index: int) -> Token:
    return Token(index, f"t{index} ", index, 0.0)


# -- the pump: the writer, or the loop -------------------------------------------------------------------------------


class Pumped:
    """A pump on a running loop, fed from a thread of its own (the engine's), with a writer and a sink that record
    what each got (the writer refuses the tokens in ``refused``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, refused: frozenset[int] = frozenset()) -> None:
        self.out: list[tuple[str, int]] = []
        self.refused = refused
        self.writer_threads: set[str] = set()
        self.pump = TokenPump(loop, self.sink, cancel=threading.Event())
        self.pump.writer = self.write

    def write(self, item: Token) -> bool:
        self.writer_threads.add(threading.current_thread().name)
        if item.id in self.refused:
            return False
        self.out.append(("writer", item.id))
        return True

    def sink(self, tokens: list[Token]) -> bool:
        self.out.extend(("sink", item.id) for item in tokens)
        return True

    async def feed(self, count: int) -> None:
        """``count`` tokens from an engine thread, then the pump finished on the loop (as a generation ends)."""
        engine = threading.Thread(target=self.run_engine, args=(count,), name="engine")
        with self.pump:
            engine.start()
            while engine.is_alive():
                await asyncio.sleep(0.001)
            engine.join()

    def run_engine(self, count: int) -> None:
        for index in range(count):
            self.pump.on_token(token(index))


def test_the_writer_takes_the_tokens_on_the_engine_thread_while_nothing_waits_for_the_loop() -> None:
    async def scenario() -> Pumped:
        pumped = Pumped(asyncio.get_running_loop())
        await pumped.feed(20)
        return pumped

    pumped = asyncio.run(scenario())
    assert pumped.out == [("writer", index) for index in range(20)]
    assert pumped.writer_threads == {"engine"}
    assert pumped.pump.delivered == 20


def test_a_token_the_writer_refuses_goes_to_the_loop_and_the_tokens_keep_their_order() -> None:
    """Token 5 refused: it is queued for the loop, and every token after it goes the loop's way too until that
    delivery has run (none may overtake it)."""

    async def scenario() -> Pumped:
        pumped = Pumped(asyncio.get_running_loop(), refused=frozenset({5, 12}))
        await pumped.feed(30)
        return pumped

    pumped = asyncio.run(scenario())
    assert [index for _, index in pumped.out] == list(range(30))
    assert ("sink", 5) in pumped.out and ("sink", 12) in pumped.out
    assert pumped.out[:5] == [("writer", index) for index in range(5)]
    assert pumped.pump.delivered == 30


def test_without_a_writer_every_token_goes_to_the_loop() -> None:
    async def scenario() -> Pumped:
        pumped = Pumped(asyncio.get_running_loop())
        pumped.pump.writer = None
        await pumped.feed(10)
        return pumped

    pumped = asyncio.run(scenario())
    assert pumped.out and all(way == "sink" for way, _ in pumped.out)
    assert [index for _, index in pumped.out] == list(range(10))
    assert pumped.writer_threads == set()


def test_a_writer_that_fails_is_dropped_with_a_log_and_its_token_goes_to_the_loop(
        caplog: pytest.LogCaptureFixture) -> None:
    async def scenario() -> Pumped:
        pumped = Pumped(asyncio.get_running_loop())

        def broken(item: Token) -> bool:
            if item.id == 3:
                raise ValueError("cannot render")
            return pumped.write(item)

        pumped.pump.writer = broken
        await pumped.feed(8)
        return pumped

    with caplog.at_level(logging.ERROR, logger="appliance.server.pump"):
        pumped = asyncio.run(scenario())
    assert [index for _, index in pumped.out] == list(range(8))
    assert pumped.out[3:] == [("sink", index) for index in range(3, 8)]
    assert pumped.pump.writer is None
    assert "writer failed" in caplog.text


def test_a_finished_pump_hands_nothing_to_its_writer() -> None:
    async def scenario() -> Pumped:
        pumped = Pumped(asyncio.get_running_loop())
        pumped.pump.start()
        pumped.pump.finish()
        await asyncio.to_thread(pumped.run_engine, 3)
        return pumped

    pumped = asyncio.run(scenario())
    assert pumped.out == []


# -- a response's writes from another thread, on a real socket -------------------------------------------------------


async def connected(sndbuf: int | None = None) -> tuple[asyncio.Transport, socket.socket]:
    ours, theirs = socket.socketpair()
    if sndbuf is not None:
        ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sndbuf)
        theirs.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sndbuf)
    theirs.setblocking(False)
    transport, _ = await asyncio.get_running_loop().create_connection(asyncio.Protocol, sock=ours)
    return transport, theirs  # type: ignore[return-value]


def received(reader: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            piece = reader.recv(1 << 20)
        except BlockingIOError:
            return data
        if not piece:
            return data
        data += piece


def from_thread(call: Callable[[], bool]) -> bool:
    """``call()`` run on a thread of its own (as the engine's), its answer."""
    answer: list[bool] = []
    thread = threading.Thread(target=lambda: answer.append(call()))
    thread.start()
    thread.join()
    return answer[0]


def test_a_thread_writes_only_after_the_head_went_out() -> None:
    async def scenario() -> tuple[bool, bool, list[str], bytes]:
        transport, reader = await connected()
        writes = HeldHeadTransport(transport, asyncio.get_running_loop())
        rendered: list[str] = []

        def render() -> bytes:
            rendered.append("rendered")
            return b"x"

        before = from_thread(lambda: writes.write_now(render))  # the head is not written yet
        writes.write(HEAD)
        held = from_thread(lambda: writes.write_now(render))  # the head is held until the step ends
        await asyncio.sleep(0)
        after = from_thread(lambda: writes.write_now(render))
        data = received(reader)
        transport.close()
        reader.close()
        return before, held, rendered, data if after else b""

    before, held, rendered, data = asyncio.run(scenario())
    assert not before and not held
    assert rendered == ["rendered"]  # rendered only when it could be written
    assert data == HEAD + b"x"


def test_what_the_socket_does_not_take_is_written_by_the_loop_before_later_writes() -> None:
    async def scenario() -> tuple[bool, bool, bool, bytes, bytes]:
        transport, reader = await connected(sndbuf=4096)
        writes = HeldHeadTransport(transport, asyncio.get_running_loop())
        writes.write(HEAD)
        await asyncio.sleep(0)
        big = bytes(range(256)) * 4096  # 1 MiB: more than the socket takes at once
        taken = from_thread(lambda: writes.write_now(lambda: big))
        held = writes.held is not None
        refused = not from_thread(lambda: writes.write_now(lambda: b"overtaking"))  # bytes wait before it
        writes.write(b"after")  # the loop's next write: behind the rest of the big one
        data = b""
        for _ in range(2000):
            data += received(reader)
            if data.endswith(b"after"):
                break
            await asyncio.sleep(0.001)
        transport.close()
        reader.close()
        return taken, held, refused, data, big

    taken, held, refused, data, big = asyncio.run(scenario())
    assert taken and held and refused
    assert data == HEAD + big + b"after"


def test_nothing_is_written_from_a_thread_once_the_wire_is_closed_or_the_transport_closes() -> None:
    async def scenario() -> tuple[bool, bool, bool, bytes]:
        transport, reader = await connected()
        loop = asyncio.get_running_loop()
        wire = Wire.of(transport)
        writes = HeldHeadTransport(transport, loop, wire)
        writes.write(HEAD)
        await asyncio.sleep(0)
        wire.close()
        closed_wire = from_thread(lambda: writes.write_now(lambda: b"late"))
        other, other_reader = await connected()
        closing = HeldHeadTransport(other, loop)
        closing.write(HEAD)
        await asyncio.sleep(0)
        other.close()
        closing_transport = from_thread(lambda: closing.write_now(lambda: b"late"))
        tls = Wire.of(FakeTls(transport)).open  # type: ignore[arg-type]
        data = received(reader)
        transport.close()
        reader.close()
        other_reader.close()
        return closed_wire, closing_transport, tls, data

    closed_wire, closing_transport, tls, data = asyncio.run(scenario())
    assert not closed_wire and not closing_transport
    assert not tls  # bytes written to a TLS connection's socket would not be the transport's
    assert data == HEAD


class FakeTls:
    """A transport whose socket carries TLS (what :meth:`Wire.of` reads of it)."""

    def __init__(self, transport: asyncio.Transport) -> None:
        self.transport = transport

    def get_extra_info(self, name: str) -> Any:
        if name == "sslcontext":
            return object()
        return self.transport.get_extra_info(name)


def test_render_answers_none_or_nothing() -> None:
    async def scenario() -> tuple[bool, bool, bytes]:
        transport, reader = await connected()
        writes = HeldHeadTransport(transport, asyncio.get_running_loop())
        writes.write(HEAD)
        await asyncio.sleep(0)
        cannot = from_thread(lambda: writes.write_now(lambda: None))
        nothing = from_thread(lambda: writes.write_now(lambda: b""))
        data = received(reader)
        transport.close()
        reader.close()
        return cannot, nothing, data

    cannot, nothing, data = asyncio.run(scenario())
    assert not cannot  # it cannot be written now: the caller takes the loop's way
    assert nothing  # rendered, nothing to write
    assert data == HEAD


def test_writes_from_a_thread_and_from_the_loop_never_cut_into_each_other() -> None:
    """A thread and the loop write numbered records as fast as they can: every record arrives whole, each side's
    in its own order."""

    async def scenario() -> tuple[bytes, int]:
        transport, reader = await connected(sndbuf=8192)
        writes = HeldHeadTransport(transport, asyncio.get_running_loop())
        writes.write(b"H\n")
        await asyncio.sleep(0)
        stop = threading.Event()
        by_thread = [0]

        def engine() -> None:
            while not stop.is_set() and by_thread[0] < 3000:
                record = b"T%05d" % by_thread[0] + b"." * 200 + b"\n"
                if writes.write_now(functools.partial(bytes, record)):
                    by_thread[0] += 1

        thread = threading.Thread(target=engine)
        thread.start()
        data = b""
        for index in range(3000):
            writes.write(b"L%05d" % index + b"-" * 100 + b"\n")
            if index % 50 == 0:
                await asyncio.sleep(0)
                data += received(reader)
        stop.set()
        thread.join()
        for _ in range(2000):
            await asyncio.sleep(0.001)
            data += received(reader)
            if transport.get_write_buffer_size() == 0 and writes.held is None and not received(reader):
                break
        data += received(reader)
        transport.close()
        reader.close()
        return data, by_thread[0]

    data, count = asyncio.run(scenario())
    lines = data.split(b"\n")[1:-1]
    assert data.startswith(b"H\n")
    loop_lines = [line for line in lines if line.startswith(b"L")]
    thread_lines = [line for line in lines if line.startswith(b"T")]
    assert len(loop_lines) + len(thread_lines) == len(lines)
    assert loop_lines == [b"L%05d" % index + b"-" * 100 for index in range(3000)]
    assert thread_lines == [b"T%05d" % index + b"." * 200 for index in range(count)]
    assert count > 0


# -- a chunk from another thread, checked under the connection's lock --------------------------------------------------


def started_cycle(transport: HeldHeadTransport) -> RequestResponseCycle:
    conn = h11.Connection(h11.SERVER)
    conn.receive_data(b"POST /s HTTP/1.1\r\nHost: a\r\nContent-Length: 0\r\n\r\n")
    while conn.next_event() not in (h11.NEED_DATA, h11.PAUSED) and conn.their_state is not h11.DONE:
        pass
    scope: Any = {"type": "http", "method": "POST", "headers": [], "http_version": "1.1"}
    return RequestResponseCycle(scope=scope, conn=conn, transport=transport,  # type: ignore[arg-type]
                                flow=FlowControl(transport), logger=logging.getLogger("test"),  # type: ignore[arg-type]
                                access_logger=logging.getLogger("test"), access_log=False, default_headers=[],
                                message_event=asyncio.Event(), on_response=lambda: None)


def test_a_chunk_from_a_thread_is_framed_and_none_comes_after_the_body_ends() -> None:
    async def scenario() -> tuple[bool, bool, bool, bytes]:
        transport, reader = await connected()
        writes = HeldHeadTransport(transport, asyncio.get_running_loop())
        cycle = started_cycle(writes)
        chunks = ChunkWriter(cycle)
        before = from_thread(lambda: chunks.write_now(lambda: b"early"))  # no head yet
        await cycle.send({"type": "http.response.start", "status": 200, "headers": []})
        await asyncio.sleep(0)
        during = from_thread(lambda: chunks.write_now(lambda: b"data: 1\n\n"))
        await cycle.send({"type": "http.response.body", "body": b"", "more_body": False})
        after = from_thread(lambda: chunks.write_now(lambda: b"late"))
        await asyncio.sleep(0)
        data = received(reader)
        transport.close()
        reader.close()
        return before, during, after, data

    before, during, after, data = asyncio.run(scenario())
    assert not before and during and not after
    assert data.endswith(b"\r\n\r\n9\r\ndata: 1\n\n\r\n0\r\n\r\n")


# -- a real appliance ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def app(tiny_model: Path) -> Iterator[Running]:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent]) as running_app:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 1}
        assert httpx.post(f"{running_app.appliance.http_url}/v1/completions", json=body, timeout=60).is_success
        running_app.settle()
        yield running_app


@pytest.fixture
def written(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, bool]]:
    """Every ``write_now`` of a response's writes: the thread that asked, and whether it wrote."""
    calls: list[tuple[str, bool]] = []
    write_now = headwrite.HeldHeadTransport.write_now

    def spied(self: HeldHeadTransport, render: Callable[[], bytes | None]) -> bool:
        answer = write_now(self, render)
        calls.append((threading.current_thread().name, answer))
        return answer

    monkeypatch.setattr(headwrite.HeldHeadTransport, "write_now", spied)
    return calls


def by_engine(written: list[tuple[str, bool]]) -> int:
    """How many writes a thread other than the harness's loop thread (``appliance``) made."""
    return sum(answer for name, answer in written if name != "appliance")


def sse_data(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON documents of a streamed request's ``data:`` lines."""
    documents = []
    with httpx.stream("POST", url, json=body, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                documents.append(json.loads(line.removeprefix("data: ")))
    return documents


def test_a_completion_streams_its_tokens_from_the_engine_thread(app: Running, written: list[tuple[str, bool]]) -> None:
    url = f"{app.appliance.http_url}/v1/completions"
    body = {"model": "tiny", "prompt": "The water", "max_tokens": 24, "temperature": 0}
    whole = httpx.post(url, json=body, timeout=60).json()["choices"][0]["text"]
    written.clear()
    parts = [document["choices"][0]["text"] for document in sse_data(url, {**body, "stream": True})]
    assert "".join(parts) == whole
    assert by_engine(written) >= 12, written  # most of the 24 tokens: the first goes with the stream's opening


def test_an_anthropic_stream_writes_its_tokens_from_the_engine_thread(app: Running,
                                                                       written: list[tuple[str, bool]]) -> None:
    url = f"{app.appliance.http_url}/v1/messages"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 24,
            "temperature": 0}
    whole = httpx.post(url, json=body, timeout=60).json()["content"][0]["text"]
    written.clear()
    documents = sse_data(url, {**body, "stream": True})
    text = "".join(document["delta"]["text"] for document in documents
                   if document["type"] == "content_block_delta" and document["delta"]["type"] == "text_delta")
    assert text == whole
    assert documents[-1]["type"] == "message_stop"
    assert by_engine(written) >= 12, written


def test_a_responses_stream_writes_its_tokens_from_the_engine_thread(app: Running,
                                                                      written: list[tuple[str, bool]]) -> None:
    url = f"{app.appliance.http_url}/v1/responses"
    body = {"model": "tiny", "input": "Tell me a story", "max_output_tokens": 24, "temperature": 0, "store": False}
    answer = httpx.post(url, json=body, timeout=60).json()
    whole = "".join(part["text"] for item in answer["output"] if item["type"] == "message"
                    for part in item["content"])
    written.clear()
    documents = sse_data(url, {**body, "stream": True})
    text = "".join(document["delta"] for document in documents if document["type"] == "response.output_text.delta")
    assert text == whole
    numbers = [document["sequence_number"] for document in documents]
    assert numbers == list(range(len(numbers)))  # every event once, in order, whoever wrote it
    assert documents[-1]["type"] in ("response.completed", "response.incomplete")
    assert by_engine(written) >= 12, written
