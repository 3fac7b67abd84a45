"""Streams and replies: what a client streams is what it gets, a client that leaves takes its request with it, and a
prompt too big for the context is refused by its size (issue #8, "Streams and replies", "Host memory")."""

from __future__ import annotations

import socket
import time
from typing import Any

import pytest
from harness import RawPeer

from appliance.client import lines as lineclient
from appliance.protocol import messages as m
from appliance.protocol.frames import encode_frame


def wait_idle(hostile, agent: str, timeout: float = 10) -> None:  # type: ignore[no-untyped-def]
    daemon = hostile.app.daemon
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and daemon.agents[agent].lock.locked():
        time.sleep(0.01)
    assert not daemon.agents[agent].lock.locked(), f"agent {agent}'s decode never ended"


def body(reply: str) -> str:
    assert reply.startswith("OK"), reply
    return lineclient.response_body(reply)


def test_a_client_that_leaves_mid_decode_takes_its_request_back(hostile) -> None:  # type: ignore[no-untyped-def]
    """DECODE 1000 tokens, hang up once generation is under way: the agent's conversation is as before the
    DECODE (not 1000 tokens nobody saw), and its next greedy continuation is that of an agent that never sent it."""
    app = hostile.app
    for agent in ("left", "ref"):
        assert app.line(f"REGISTER {agent} demo").startswith("OK")
        body(app.line(f"DECODE {agent} 8 Once upon"))
    conversation = app.daemon.agents["left"].conversation
    before = list(conversation.tokens)
    assert before == app.daemon.agents["ref"].conversation.tokens
    for _ in range(3):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.connect(str(app.socket))
            sock.sendall(b"DECODE left 1000 and then\n")
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and len(conversation.tokens) < len(before) + 20:
                time.sleep(0.001)
            assert len(conversation.tokens) >= len(before) + 20  # generating when the client leaves
        wait_idle(hostile, "left")
        assert conversation.tokens == before
    assert body(app.line("DECODE left 12")) == body(app.line("DECODE ref 12"))
    assert conversation.tokens == app.daemon.agents["ref"].conversation.tokens
    for agent in ("left", "ref"):
        app.line(f"UNREGISTER {agent}")


@pytest.fixture(scope="module")
def big_prompt_frame() -> bytes:
    """A frame with a 12 MB prompt, built before the appliance starts: encoding it holds this process's GIL for
    100 ms or more, and the appliance under test runs in this process."""
    return encode_frame({"type": "INFER_REQUEST", "task_id": "big", "model": "demo", "max_tokens": 4,
                         "prompt": "hello world " * 1_000_000, "temperature": 0})


def test_a_12_mb_prompt_is_refused_by_its_size_while_the_neighbour_is_served(big_prompt_frame, hostile) -> None:  # type: ignore[no-untyped-def]
    """Before: tokenized whole (+480 MB, 2.9 s of engine time) before the context check refused it. Now refused by
    its byte size (the room left x the vocabulary's longest token piece) without being tokenized."""
    runtime = hostile.app.daemon.models["demo"].runtime.inner  # the neighbour keeps it loaded; inside the gate
    tokenized: list[int] = []
    real = runtime.weights.tokenize

    def counting(text: str, *args: Any, **kwargs: Any) -> list[int]:
        tokenized.append(len(text.encode()))
        return real(text, *args, **kwargs)

    runtime.weights.tokenize = counting
    served = hostile.neighbour.served
    peer = RawPeer(hostile.socket)
    frame = big_prompt_frame
    took: list[float] = []
    try:
        for _ in range(3):
            start = time.monotonic()
            peer.sock.sendall(frame)
            end = peer.read_until_end("big")[-1]
            took.append(time.monotonic() - start)
            assert isinstance(end, m.ErrorMessage) and end.error.code == "CONTEXT_OVERFLOW", end
            assert end.error.details["prompt_bytes"] == 12_000_000
            assert end.error.details["max_prompt_bytes"] == 1023 * runtime.longest_piece
        peer.send({"type": "INFER_REQUEST", "task_id": "small", "model": "demo", "prompt": "Hello",
                   "max_tokens": 4, "temperature": 0})
        done = peer.read_until_end("small")[-1]
        assert isinstance(done, m.TaskComplete) and done.usage.completion_tokens == 4
    finally:
        peer.close()
        del runtime.weights.tokenize
    assert max(tokenized) < 1000  # the neighbour's and the small prompt: never the 12 MB one
    assert min(took) < 1.0, f"refusing a 12 MB prompt took {took} s"
    assert hostile.neighbour_served_since(served)


def test_sampled_streams_carry_exactly_the_final_text(hostile) -> None:  # type: ignore[no-untyped-def]
    """Temperature 0.8 on a random-weight model: byte tokens that end mid-character are common; the STREAM_TOKEN
    texts joined are TASK_COMPLETE's text every time, and max_tokens past the context stops there with length."""
    peer = RawPeer(hostile.socket)
    try:
        for i in range(40):
            task = f"s{i}"
            peer.send({"type": "INFER_REQUEST", "task_id": task, "model": "demo-b", "prompt": f"Hello {i}",
                       "max_tokens": 24, "temperature": 0.8, "stream": True})
            got = peer.read_until_end(task)
            done = got[-1]
            assert isinstance(done, m.TaskComplete), done
            assert "".join(msg.text for msg in got if isinstance(msg, m.StreamToken)) == done.text, task
        peer.send({"type": "INFER_REQUEST", "task_id": "long", "model": "demo-b", "prompt": "Hello",
                   "max_tokens": 100_000, "temperature": 0, "stream": True})
        got = peer.read_until_end("long")
        done = got[-1]
        assert isinstance(done, m.TaskComplete) and done.stop_reason == "length", done
        assert done.usage.prompt_tokens + done.usage.completion_tokens == 512  # demo-b's n_ctx
        assert "".join(msg.text for msg in got if isinstance(msg, m.StreamToken)) == done.text
    finally:
        peer.close()
