"""How a streamed generation goes out on the wire, read as raw HTTP/1.1 from a real appliance with a real tiny
model: every body message is one HTTP chunk (chunked transfer encoding), so the chunks show the writes. What is
ready at a wake-up is one write: the opening event with the first tokens, one write per delivery of tokens, and the
end (finish, usage, ``[DONE]``) in one."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from harness import Running, running

from appliance.http import sse

TOKENS = 6


@pytest.fixture(scope="module")
def app(tiny_model: Path) -> Iterator[Running]:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent]) as running_app:
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 1}
        assert httpx.post(f"{running_app.appliance.http_url}/v1/completions", json=body, timeout=60).is_success
        running_app.settle()  # loaded and warmed up: the first token comes before any heartbeat
        yield running_app


def http_chunks(raw: bytes) -> tuple[bytes, list[bytes]]:
    """A chunked HTTP/1.1 response's head and its body chunks, as sent."""
    head, _, rest = raw.partition(b"\r\n\r\n")
    assert b"transfer-encoding: chunked" in head.lower()
    chunks: list[bytes] = []
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return head, chunks
        chunks.append(rest[:size])
        assert rest[size:size + 2] == b"\r\n"
        rest = rest[size + 2:]


def streamed(app: Running, path: str, body: dict[str, Any]) -> list[bytes]:
    """The body chunks of one streamed request (the engine takes ``delay_s`` per step: each token is its own
    delivery)."""
    host, port = app.appliance.http_url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    app.engine.delay_s = 0.02
    try:
        with socket.create_connection((host, int(port)), timeout=30) as sock:
            sock.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
                         b"Content-Type: application/json\r\nContent-Length: " + str(len(data)).encode() +
                         b"\r\n\r\n" + data)
            raw = b""
            while piece := sock.recv(65536):
                raw += piece
    finally:
        app.engine.delay_s = 0.0
    head, chunks = http_chunks(raw)
    assert head.startswith(b"HTTP/1.1 200"), head
    return chunks


def writes_of(chunks: list[bytes]) -> list[list[str]]:
    """The data of the SSE events of each write, each event whole (a write never splits one); heartbeats (``:
    ping`` comments, sent while the first token is slow to come) left out, and a write of nothing else with them."""
    writes = []
    for chunk in chunks:
        assert chunk.endswith(b"\n\n")
        blocks = [block for block in chunk.decode().split("\n\n") if block and not block.startswith(":")]
        if blocks:
            writes.append([block.removeprefix("data: ") for block in blocks])
    return writes


def test_a_chat_stream_opens_with_its_first_tokens_and_ends_in_one_write(app: Running) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": TOKENS,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    writes = writes_of(streamed(app, "/v1/chat/completions", body))
    first = [json.loads(event) for event in writes[0]]
    assert first[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert len(first) == 2 and first[1]["choices"][0]["delta"]["content"]
    last = writes[-1]
    assert last[-1] == "[DONE]"
    usage = json.loads(last[-2])["usage"]
    assert json.loads(last[-3])["choices"][0]["finish_reason"] == "length"
    assert usage["completion_tokens"] == TOKENS
    assert len(writes) <= TOKENS + 1  # one write per delivery of tokens, and the end


def test_a_completion_stream_is_one_write_per_delivery_and_one_for_its_end(app: Running) -> None:
    body = {"model": "tiny", "prompt": "The water", "max_tokens": TOKENS, "temperature": 0, "stream": True}
    writes = writes_of(streamed(app, "/v1/completions", body))
    assert all(len(write) == 1 for write in writes[:-1])  # each delivery: one event with its tokens' text
    assert writes[-1][-1] == "[DONE]"
    assert json.loads(writes[-1][-2])["choices"][0]["finish_reason"] == "length"
    assert len(writes) <= TOKENS + 1


def test_an_anthropic_stream_opens_with_its_first_tokens_and_ends_in_one_write(app: Running) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": TOKENS,
            "temperature": 0, "stream": True}  # greedy, as the chat stream's: a sampled first token may be held back
    writes = [chunk.decode() for chunk in streamed(app, "/v1/messages", body)]
    assert all(write.endswith("\n\n") for write in writes)
    assert "event: message_start" in writes[0] and "event: content_block_delta" in writes[0]
    assert "event: message_delta" in writes[-1] and writes[-1].count("event: ") >= 3  # block stop, delta, stop
    assert writes[-1].rstrip().endswith('data: {"type":"message_stop"}')
    assert len(writes) <= TOKENS + 1


def test_ready_takes_what_is_queued_without_waiting() -> None:
    async def scenario() -> tuple[list[Any], list[Any]]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        alone = sse.ready(queue, "a")
        for item in ("c", "d"):
            queue.put_nowait(item)
        return alone, sse.ready(queue, "b")

    alone, together = asyncio.run(scenario())
    assert alone == ["a"] and together == ["b", "c", "d"]


def test_deliveries_group_what_came_together_and_mark_the_last() -> None:
    end = object()

    async def scenario() -> list[tuple[list[Any], bool]]:
        queue: asyncio.Queue[Any] = asyncio.Queue()
        queue.put_nowait("b")
        got = []
        async for items, last in sse.deliveries(queue, "a", end):
            got.append((items, last))
            if items == ["a", "b"]:
                asyncio.get_running_loop().call_soon(queue.put_nowait, "c")
            elif items == ["c"]:
                for item in ("d", end):
                    queue.put_nowait(item)
        return got

    assert asyncio.run(scenario()) == [(["a", "b"], False), (["c"], False), (["d"], True)]
