"""Connections: starvation, slow dribblers, incomplete big frames, a client that never reads, HTTP counted.

What was seen before the fix (issue 8): one connection queued 3,000 requests and every other client waited more
than 60 s (FIFO engine queue); 128 slow-dribbling connections denied the socket to everyone; 40 connections each
holding an incomplete 16 MiB frame held 640 MB with no timeout; a client that never reads had 120,000 tokens
generated for nobody; HTTP had no header timeout and its connections were not counted.
"""

from __future__ import annotations

import contextlib
import ctypes
import http.client
import json
import socket
import threading
import time
from pathlib import Path

import pytest
from harness import RawPeer
from hostile_checks import HUNG_S, rss_bytes

from appliance.protocol import messages as m
from appliance.protocol.frames import HEADER, MAGIC, NEED_DATA, VERSION, FrameParser, encode_frame

MiB = 1024 * 1024


def line_request(path: Path, text: str, timeout: float = HUNG_S) -> str:
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        sock.sendall(text.encode() + b"\n")
        reply = b""
        while not (reply.startswith(b"ERR ") and reply.endswith(b"\n")) and not reply.endswith(b"END_RESPONSE\n"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
        return reply.decode()


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the daemon sends until it closes the connection (TimeoutError if it does not in time). A close
    with bytes of ours still unread on its side reaches us as a reset once its reply has been read: closed too."""
    sock.settimeout(timeout)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def infer_frames(count: int, max_tokens: int, **fields: object) -> bytes:
    return b"".join(encode_frame({"type": "INFER_REQUEST", "task_id": f"t{i}", "prompt": "go on",
                                  "max_tokens": max_tokens, "temperature": 0, **fields}) for i in range(count))


def test_tasks_beyond_max_tasks_per_connection_are_refused_and_the_connection_goes_on(hostile):
    """300 INFER_REQUESTs at once on one connection: at most max_tasks_per_connection (4) are in flight, the
    others get TOO_MANY_TASKS with the limit, and the connection keeps working."""
    hog = RawPeer(hostile.socket)
    try:
        hog.sock.sendall(infer_frames(300, 8, model="demo"))
        completed, refused = 0, []
        while completed + len(refused) < 300:
            msg = hog.read()
            if isinstance(msg, m.TaskComplete):
                completed += 1
            elif not isinstance(msg, m.Heartbeat):
                assert isinstance(msg, m.ErrorMessage) and msg.error.code == "TOO_MANY_TASKS", msg
                refused.append(msg)
        assert 4 <= completed < 300
        assert refused[0].error.details == {"max_tasks_per_connection": 4} and refused[0].error.retryable
        hog.send({"type": "PROTOCOL_INFO"})
        assert isinstance(hog.read(), m.ProtocolInfo)
    finally:
        hog.close()


@pytest.mark.hostile_config(max_tasks_per_connection=64)
def test_a_connection_queueing_many_requests_does_not_starve_the_neighbour(hostile):
    """One connection queues 64 generations at once (the limit raised for the case): the engine serves its
    queue and the neighbour's agent in turn, one job each, so the neighbour waits for one of the hog's jobs at
    most, not for all 64 (a FIFO queue made every other client wait more than 60 s for 3,000 such requests)."""
    hog = RawPeer(hostile.socket)
    served = hostile.neighbour.served
    latencies_before = len(hostile.neighbour.latencies_ms)
    try:
        start = time.monotonic()
        # 96 tokens a job: the engine runs the hog's jobs 4 at a time, and with 32 its first 48 took 220 ms on CI, about
        # four of the neighbour's 50 ms periods, too short a window to tell round-robin (3 or more) from FIFO (1)
        hog.sock.sendall(infer_frames(64, 96, model="demo"))
        completed = 0
        served_while_hog_busy = 0
        while completed < 64:
            msg = hog.read()
            if isinstance(msg, m.Heartbeat):
                continue  # the queued tasks' heartbeats
            assert isinstance(msg, m.TaskComplete), msg
            completed += 1
            if completed == 48:
                served_while_hog_busy = hostile.neighbour.served - served
        hog_ms = (time.monotonic() - start) * 1000
    finally:
        hog.close()
    during = hostile.neighbour.latencies_ms[latencies_before:]
    print(f"neighbour: {served_while_hog_busy} answers while the hog's first 48 of 64 jobs ran, "
          f"max wait {max(during, default=0):.0f} ms; the hog's 64 jobs took {hog_ms:.0f} ms")
    # FIFO: the neighbour's next request waits behind the hog's whole queue, so it is served at most once while the
    # hog's jobs run; round-robin: it waits for one hog job (whose length, on a loaded 2-core box, varies a lot).
    assert served_while_hog_busy >= 3
    assert max(during) < HUNG_S * 1000


@pytest.mark.hostile_config(max_connections=40, socket={"request_timeout_s": 1})
def test_slow_dribblers_are_timed_out_and_a_new_client_gets_in(hostile):
    """60 connections that dribble a request line a byte at a time (more than max_connections): each is closed
    once its line has taken longer than request_timeout_s, and a new client is answered within a bound."""
    dribblers: list[socket.socket] = []
    try:
        for _ in range(60):
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(str(hostile.socket))
            dribblers.append(sock)
        stop = threading.Event()

        def dribble() -> None:
            while not stop.is_set():
                for sock in dribblers:
                    with contextlib.suppress(OSError):
                        sock.send(b"S")  # "SSSS…": a line that never ends
                stop.wait(0.2)

        thread = threading.Thread(target=dribble, daemon=True)
        thread.start()
        start = time.monotonic()
        reply = ""
        while time.monotonic() - start < 8 and not reply.startswith("OK"):
            with contextlib.suppress(OSError):
                reply = line_request(hostile.socket, "STATUS", timeout=5)
        waited = time.monotonic() - start
        stop.set()
        thread.join(5)
        assert reply.startswith("OK"), reply
        assert waited < 6, f"a new client waited {waited:.1f} s"
        replies = [read_until_closed(sock, 5) for sock in dribblers]  # every dribbler is closed, and told why
        timed_out = [r for r in replies if r.startswith(b"ERR TIMEOUT")]
        refused = [r for r in replies if r.startswith(b"ERR TOO_MANY_CONNECTIONS")]
        assert len(timed_out) + len(refused) == 60
        assert timed_out and b"request_timeout_s=1" in timed_out[0]
    finally:
        for sock in dribblers:
            sock.close()


@pytest.mark.hostile_config(socket={"request_timeout_s": 1})
def hold_incomplete_frames(hostile) -> int:  # type: ignore[no-untyped-def]
    """40 connections each announce a 16 MiB frame and send 2 MiB of it; each must get ERROR TIMEOUT once
    request_timeout_s passed and be closed. Returns the RSS the daemon held meanwhile."""
    rss_before = rss_bytes()
    header = HEADER.pack(MAGIC, VERSION, 16 * MiB - 16)
    part = b"A" * (2 * MiB)
    socks: list[socket.socket] = []
    try:
        for _ in range(40):
            sock = socket.socket(socket.AF_UNIX)
            sock.connect(str(hostile.socket))
            sock.sendall(header + part)
            socks.append(sock)
        held = rss_bytes() - rss_before
        start = time.monotonic()
        for sock in socks:
            reply = read_until_closed(sock, 10)
            parser = FrameParser()
            parser.receive_data(reply)
            event = parser.next_event()
            assert event is not NEED_DATA
            error = m.parse_message(event.payload)
            assert isinstance(error, m.ErrorMessage) and error.error.code == "TIMEOUT"
            assert error.error.details == {"request_timeout_s": 1}
        released_after = time.monotonic() - start
    finally:
        for sock in socks:
            sock.close()
    assert released_after < 6
    deadline = time.monotonic() + 5
    while len(hostile.app.appliance.socket_server.connections) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(hostile.app.appliance.socket_server.connections) == 1  # the neighbour's
    return held


def settled_rss(baseline: int, bound: int) -> int:
    """RSS above ``baseline`` once it falls under ``bound`` (or after 5 s): glibc keeps freed heap pages until
    trimmed, so trim at each look; the other threads' arenas give theirs back as those threads run."""
    deadline = time.monotonic() + 5
    while True:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        above = rss_bytes() - baseline
        if above < bound or time.monotonic() > deadline:
            return above
        time.sleep(0.1)


@pytest.mark.hostile_config(socket={"request_timeout_s": 1})
def test_incomplete_big_frames_are_released_after_the_request_timeout(hostile):
    """40 connections each hold an incomplete 16 MiB frame: the daemon holds their bytes (RSS grows), then drops
    each with ERROR TIMEOUT once request_timeout_s passed, and the memory comes back. The first round also makes
    what a process makes once (arenas, buffers, caches); the second is measured against what the first left."""
    held = hold_incomplete_frames(hostile)
    assert held > 40 * MiB  # the daemon did hold them (else this test shows nothing)
    baseline = rss_bytes()
    hold_incomplete_frames(hostile)  # (its pages come from the first round's freed ones: RSS grows less)
    after = settled_rss(baseline, 20 * MiB)
    print(f"RSS held by 40 incomplete frames: {held / MiB:.0f} MiB; after release: {after / MiB:+.0f} MiB")
    assert after < 20 * MiB


@pytest.mark.hostile_config(socket={"stall_timeout_s": 1})
def test_a_stream_nobody_reads_is_paused_then_cancelled(hostile):
    """A MAGN client asks for three 1,000-token streams and never reads: once the connection's unread backlog
    passes the high-water mark the generation pauses, and after stall_timeout_s it is cancelled with TIMEOUT;
    far fewer tokens are generated than asked for (a sampled stream may also end early on EOS: hence three)."""
    latencies_before = len(hostile.neighbour.latencies_ms)
    peer = RawPeer(hostile.socket)
    ends: dict[str, m.Message] = {}
    streamed = 0
    try:
        for i, prompt in enumerate(("Once upon a time", "The weather today", "In a galaxy far away")):
            peer.send({"type": "INFER_REQUEST", "task_id": f"deaf{i}", "model": "demo", "prompt": prompt,
                       "max_tokens": 1000, "temperature": 0.8, "stream": True})
        deadline = time.monotonic() + 30
        server = hostile.app.appliance.socket_server
        while time.monotonic() < deadline and hostile.app.daemon.counters["decodes"] < 3 + hostile.neighbour.served:
            time.sleep(0.1)  # not reading: the streams pause, then time out
        time.sleep(1.5)
        assert server.connections  # the daemon kept the connection: a stall ends tasks, not connections
        while len(ends) < 3:
            msg = peer.read()
            if isinstance(msg, m.StreamToken):
                streamed += 1
            elif isinstance(msg, m.ErrorMessage | m.TaskComplete):
                ends[msg.task_id] = msg
    finally:
        peer.close()
    timeouts = [e for e in ends.values() if isinstance(e, m.ErrorMessage)]
    assert timeouts, ends
    assert all(e.error.code == "TIMEOUT" and e.error.details["stall_timeout_s"] == 1 for e in timeouts)
    generated = sum(e.error.details["completion_tokens"] for e in timeouts) + sum(
        e.usage.completion_tokens for e in ends.values() if isinstance(e, m.TaskComplete))
    waits = hostile.neighbour.latencies_ms[latencies_before:]
    print(f"streams nobody read: {generated} tokens generated of 3000 asked, {streamed} streamed, "
          f"{len(timeouts)} timed out; the neighbour's longest wait meanwhile {max(waits, default=0):.0f} ms "
          "(a paused stream holds the engine thread)")
    assert generated < 2000 and streamed <= generated


@pytest.mark.hostile_config(max_connections=6, socket={"request_timeout_s": 1})
def test_http_connections_count_against_max_connections(hostile):
    """The neighbour and the prober hold 2 slots; 4 kept-alive HTTP connections fill the rest: a socket client
    then gets TOO_MANY_CONNECTIONS and a 5th HTTP connection a P4 503. An HTTP client that dribbles its request
    head is closed after request_timeout_s and gives its slot back."""
    host, port = hostile.http.removeprefix("http://").rsplit(":", 1)
    conns = [http.client.HTTPConnection(host, int(port), timeout=HUNG_S) for _ in range(4)]
    try:
        for conn in conns:
            conn.request("GET", "/v1/health")
            assert conn.getresponse().read()
        assert line_request(hostile.socket, "STATUS").startswith("ERR TOO_MANY_CONNECTIONS max_connections=6")
        extra = http.client.HTTPConnection(host, int(port), timeout=HUNG_S)
        extra.request("GET", "/v1/health")
        response = extra.getresponse()
        error = json.loads(response.read())["error"]
        assert response.status == 429 and error["code"] == "TOO_MANY_CONNECTIONS"
        assert error["details"] == {"max_connections": 6} and error["retryable"] is True
        extra.close()
        conns.pop().close()  # one slot free: a slowloris takes it, then loses it
        slow = socket.create_connection((host, int(port)), timeout=HUNG_S)
        slow.sendall(b"GET /v1/health HTTP/1.1\r\nHost: x\r\n")  # the head never ends
        time.sleep(0.3)
        assert line_request(hostile.socket, "STATUS").startswith("ERR TOO_MANY_CONNECTIONS")
        start = time.monotonic()
        assert read_until_closed(slow, 5) == b""
        assert time.monotonic() - start < 3
        slow.close()
        reply = ""
        deadline = time.monotonic() + 5
        while not reply.startswith("OK") and time.monotonic() < deadline:
            reply = line_request(hostile.socket, "STATUS")
        assert reply.startswith("OK"), reply
    finally:
        for conn in conns:
            conn.close()
