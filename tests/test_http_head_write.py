"""A response's head waits for its body (appliance/http/headwrite.py): on a real asyncio transport over a real
socket pair, the head is held while its step runs, leaves joined with a body written in the same step, and leaves
alone at the end of a step that wrote nothing after it; against a real appliance, a small response arrives whole in
one read."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path

import httpx
from harness import running

from appliance.http.headwrite import HeldHeadTransport

HEAD = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n"


def pending(reader: socket.socket) -> bytes:
    """What the other end has received so far, without waiting."""
    try:
        return reader.recv(65536)
    except BlockingIOError:
        return b""


async def connected() -> tuple[asyncio.Transport, socket.socket]:
    ours, theirs = socket.socketpair()
    theirs.setblocking(False)
    transport, _ = await asyncio.get_running_loop().create_connection(asyncio.Protocol, sock=ours)
    return transport, theirs  # type: ignore[return-value]


def test_the_head_leaves_with_the_body_written_in_its_step() -> None:
    async def scenario() -> tuple[bytes, bytes, bytes]:
        transport, reader = await connected()
        writes = HeldHeadTransport(transport, asyncio.get_running_loop())
        writes.write(HEAD)
        held = pending(reader)
        writes.write(b"{}")
        joined = pending(reader)
        await asyncio.sleep(0)  # the step ends: nothing more is written
        after = pending(reader)
        transport.close()
        reader.close()
        return held, joined, after

    held, joined, after = asyncio.run(scenario())
    assert held == b""
    assert joined == HEAD + b"{}"
    assert after == b""


def test_a_head_alone_leaves_at_the_end_of_its_step_and_later_writes_go_at_once() -> None:
    async def scenario() -> tuple[bytes, bytes, bytes]:
        transport, reader = await connected()
        writes = HeldHeadTransport(transport, asyncio.get_running_loop())
        writes.write(HEAD)  # a stream's head: its first event is not ready yet
        held = pending(reader)
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        alone = pending(reader)
        writes.write(b"data: 1\n\n")
        event = pending(reader)
        transport.close()
        reader.close()
        return held, alone, event

    held, alone, event = asyncio.run(scenario())
    assert held == b""
    assert alone == HEAD
    assert event == b"data: 1\n\n"


def test_closing_writes_the_held_head_first() -> None:
    async def scenario() -> tuple[bytes, bool]:
        transport, reader = await connected()
        writes = HeldHeadTransport(transport, asyncio.get_running_loop())
        writes.write(HEAD)
        writes.close()
        await asyncio.sleep(0.05)
        received = pending(reader)
        reader.close()
        return received, writes.is_closing()

    received, closing = asyncio.run(scenario())
    assert received == HEAD
    assert closing


def test_a_small_response_arrives_whole_in_one_read(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent]) as app:
        url = httpx.URL(app.appliance.http_url)
        with socket.create_connection((url.host, url.port), timeout=10) as client:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(3):  # keep-alive: every response of the connection
                client.sendall(b"GET /v1/nope HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                first = client.recv(65536)
                head, _, body = first.partition(b"\r\n\r\n")
                length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                                  if line.lower().startswith(b"content-length:")))
                assert head.startswith(b"HTTP/1.1 404 ")
                assert len(body) == length, first  # the head did not leave without its body
