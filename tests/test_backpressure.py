"""Connections under pressure: read timeouts (pure clock), stream backpressure (the token pump), the line session's
bounded read-ahead, idle and header timeouts, and a stop that does not wait on a client that never reads."""

from __future__ import annotations

import asyncio
import dataclasses
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
from harness import running

from appliance.config.types import SocketConfig
from appliance.engine.interface import Token
from appliance.protocol import messages as m
from appliance.protocol.frames import NEED_DATA, FrameParser, encode_frame
from appliance.server.peer import STREAM_HIGH_WATER, ReadClock
from appliance.server.pump import TokenPump

MiB = 1024 * 1024
SETTINGS = SocketConfig(path=Path("x"), mode=0o660, group=None, request_timeout_s=10, idle_timeout_s=300,
                        stall_timeout_s=10)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def clock_with(settings: SocketConfig = SETTINGS) -> tuple[ReadClock, Clock]:
    now = Clock()
    return ReadClock(lambda: settings, now), now


# -- the read clock (pure) -------------------------------------------------------------------------------------------


def test_a_connection_that_sends_nothing_gets_the_request_timeout_from_its_accept() -> None:
    clock, now = clock_with()
    assert clock.timeout() == 10
    now.now += 9.9
    assert clock.expired() is None
    now.now += 0.1
    assert clock.expired() == "request"
    assert clock.error("line").details == {"request_timeout_s": 10}


def test_a_started_request_must_arrive_whole_however_slowly_it_dribbles() -> None:
    clock, now = clock_with()
    clock.pending(False)  # the first request came whole
    clock.received()
    clock.pending(True)  # the next one started at 100
    for _ in range(9):
        now.now += 1
        clock.received()  # a byte a second: bytes alone do not extend the deadline
        clock.pending(True)
    assert clock.expired() is None and clock.timeout() == pytest.approx(1)
    now.now += 1
    assert clock.expired() == "request"


def test_idle_timeout_counts_from_the_last_byte_or_task_and_not_while_a_task_runs() -> None:
    clock, now = clock_with()
    clock.pending(False)
    clock.received()
    clock.busy(True)
    now.now += 1000
    assert clock.expired() is None and clock.timeout() == 300  # looks again later
    clock.busy(False)  # the idle clock starts now
    now.now += 299
    assert clock.expired() is None and clock.timeout() == pytest.approx(1)
    now.now += 1
    assert clock.expired() == "idle"
    assert clock.error("frame").details == {"idle_timeout_s": 300}


def test_idle_timeout_zero_means_never() -> None:
    clock, now = clock_with(dataclasses.replace(SETTINGS, idle_timeout_s=0))
    clock.pending(False)
    now.now += 1e6
    assert clock.timeout() is None and clock.expired() is None


# -- the token pump's backpressure (no model) -----------------------------------------------------------------------


async def wait_until(condition, timeout: float = 10) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def test_a_stream_pauses_above_the_high_water_mark_resumes_when_read_and_is_cancelled_when_stalled() -> None:
    backlog = [0]
    delivered: list[int] = []
    produced = [0]
    cancel = threading.Event()

    def sink(tokens: list[Token]) -> bool:
        delivered.extend(t.index for t in tokens)
        return True

    async def scenario() -> TokenPump:
        loop = asyncio.get_running_loop()
        pump = TokenPump(loop, sink, cancel=cancel, backlog=lambda: backlog[0], stall_timeout_s=lambda: 0.3)

        def engine() -> None:  # a generation: one token after another until cancelled
            while not cancel.is_set() and produced[0] < 100_000:
                pump.on_token(Token(produced[0], "x", produced[0], 0.0))
                produced[0] += 1

        with pump:
            backlog[0] = STREAM_HIGH_WATER + 1  # the client stopped reading
            thread = threading.Thread(target=engine)
            thread.start()
            await wait_until(lambda: pump.paused)
            held_at = produced[0]
            await asyncio.sleep(0.1)
            assert produced[0] <= held_at + 1  # the engine thread waits in on_token
            backlog[0] = 0  # the client read its backlog
            await wait_until(lambda: not pump.paused and produced[0] > held_at + 1)
            backlog[0] = STREAM_HIGH_WATER + 1  # and stops again, for good
            await wait_until(lambda: cancel.is_set())
            await asyncio.to_thread(thread.join, 10)
            assert not thread.is_alive()
        return pump

    pump = asyncio.run(scenario())
    assert pump.stalled and pump.pauses >= 2
    assert produced[0] < 100_000
    assert delivered == list(range(len(delivered))) and len(delivered) >= produced[0] - 1


def test_a_stream_without_backlog_never_pauses() -> None:
    cancel = threading.Event()

    async def scenario() -> TokenPump:
        pump = TokenPump(asyncio.get_running_loop(), lambda tokens: True, cancel=cancel)
        with pump:
            await asyncio.to_thread(lambda: [pump.on_token(Token(i, "x", i, 0.0)) for i in range(1000)])
        return pump

    pump = asyncio.run(scenario())
    assert not pump.stalled and pump.pauses == 0 and pump.delivered == 1000


# -- real sockets ---------------------------------------------------------------------------------------------------


@pytest.fixture
def model_dir(tmp_path: Path, tiny_model: Path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(tiny_model, folder / "tiny.gguf")
    return folder


def read_reply(sock: socket.socket) -> bytes:
    data = b""
    while not data.endswith(b"END_RESPONSE\n") and not (data.startswith(b"ERR") and data.endswith(b"\n")):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_pipelined_bytes_during_a_decode_are_bounded(model_dir: Path) -> None:
    """While a DECODE is held, a client streams 256 MiB of pipelined blank lines: the daemon takes a few MiB
    (its read-ahead, the stream reader's buffer and the kernel's) and then the client's writes block; the
    process does not grow with what is offered (the issue saw 4.8 GB accepted in 18 s)."""
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir]) as app:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(30)
            sock.connect(str(app.socket))
            sock.sendall(b"REGISTER a tiny\n")
            assert read_reply(sock).startswith(b"OK")
            app.engine.gate.close()
            sock.sendall(b"DECODE a 2 Hello\n")
            app.engine.gate.wait_arrived(1)
            sent = [0]
            chunk = b"\n" * 65536

            def flood() -> None:
                with pytest.raises(OSError):
                    sock.settimeout(3)
                    for _ in range(256 * 16):
                        sock.sendall(chunk)  # blocks once the daemon stops reading; times out there
                        sent[0] += len(chunk)

            rss_before = rss_bytes()
            flooder = threading.Thread(target=flood)
            flooder.start()
            flooder.join(60)
            grown = rss_bytes() - rss_before
            print(f"accepted {sent[0] / MiB:.1f} MiB of 256 MiB offered; RSS {grown / MiB:+.0f} MiB")
            assert sent[0] < 32 * MiB
            assert grown < 32 * MiB
            sock.settimeout(30)
            app.engine.gate.open()
            assert read_reply(sock).startswith(b"OK")  # the DECODE is answered; the blank lines are skipped
        assert app.line("STATUS").startswith("OK")


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def test_an_idle_connection_is_closed_after_idle_timeout(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir],
                 socket={"path": "a.sock", "idle_timeout_s": 0.5}) as app, socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(app.socket))
        sock.sendall(b"HELP\n")
        assert read_reply(sock).startswith(b"OK")
        start = time.monotonic()
        assert read_reply(sock) == b"ERR TIMEOUT idle_timeout_s=0.500\n"
        assert sock.recv(100) == b""
        assert 0.4 < time.monotonic() - start < 5


def test_a_connection_that_sends_nothing_is_closed_after_request_timeout(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir],
                 socket={"path": "a.sock", "request_timeout_s": 0.5}) as app:
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(10)
            sock.connect(str(app.socket))
            start = time.monotonic()
            assert sock.recv(100) == b""  # the header timeout: closed without a word (no protocol yet)
            assert 0.4 < time.monotonic() - start < 5
        assert len(app.appliance.socket_server.connections) == 0


def test_stop_completes_while_a_client_that_never_reads_has_tasks_in_flight(model_dir: Path) -> None:
    """SIGTERM's path (Appliance.stop) with a MAGN client that asked for streams and reads nothing: the stop does
    not wait on its drain forever (the issue: the process hung after removing its socket)."""
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir]) as app:
        deaf = socket.socket(socket.AF_UNIX)
        deaf.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        deaf.connect(str(app.socket))
        app.engine.delay_s = 0.002
        for task in ("a", "b", "c"):
            deaf.sendall(encode_frame({"type": "INFER_REQUEST", "task_id": task, "model": "tiny", "prompt": "Hi",
                                       "max_tokens": 1000, "temperature": 0.8, "stream": True}))
        deadline = time.monotonic() + 30
        while app.daemon.snapshot()["models"] == [] and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1)  # streaming into a socket nobody reads
        # and a line client that pipelines commands and reads none of its replies: once the kernel's buffer is
        # full, its session waits in drain()
        deaf_lines = socket.socket(socket.AF_UNIX)
        deaf_lines.connect(str(app.socket))
        deaf_lines.sendall(b"HELP\n" * 40_000)
        server = app.appliance.socket_server
        deadline = time.monotonic() + 30
        while max(w.transport.get_write_buffer_size() for w in server.writers.values()) == 0:
            assert time.monotonic() < deadline, "the line session never filled its buffers"
            time.sleep(0.05)
        start = time.monotonic()
        app.call(app.appliance.stop(), timeout=30)
        took = time.monotonic() - start
        deaf.close()
        deaf_lines.close()
        print(f"stop took {took:.1f} s")
        assert took < 10


def test_a_stream_that_is_read_late_resumes_and_completes(model_dir: Path) -> None:
    """Backpressure is flow control, not an error: a client that reads after a pause shorter than the stall
    timeout gets its whole stream, the same text as its TASK_COMPLETE."""
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir]) as app, \
            socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(30)
        sock.connect(str(app.socket))
        sock.sendall(encode_frame({"type": "INFER_REQUEST", "task_id": "t", "model": "tiny", "prompt": "Hi",
                                   "max_tokens": 1500, "temperature": 0.8, "stream": True}))
        time.sleep(2)
        parser = FrameParser()
        texts: list[str] = []
        end = None
        while end is None:
            event = parser.next_event()
            if event is NEED_DATA:
                parser.receive_data(sock.recv(65536))
                continue
            msg = m.parse_message(event.payload)
            if isinstance(msg, m.StreamToken):
                texts.append(msg.text)
            elif not isinstance(msg, m.Heartbeat):
                end = msg
        assert isinstance(end, m.TaskComplete), end
        assert end.text == "".join(texts)


def read_message(sock: socket.socket, parser: FrameParser) -> m.Message | None:
    """The next message that is not a HEARTBEAT, or None when the daemon closed the connection."""
    while True:
        event = parser.next_event()
        if event is not NEED_DATA:
            msg = m.parse_message(event.payload)
            if not isinstance(msg, m.Heartbeat):
                return msg
            continue
        chunk = sock.recv(65536)
        if not chunk:
            return None
        parser.receive_data(chunk)


def test_a_magn_connection_is_not_idle_while_its_task_runs_and_is_closed_once_idle(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir],
                 socket={"path": "a.sock", "idle_timeout_s": 0.5}) as app, socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(app.socket))
        parser = FrameParser()
        app.engine.gate.close()
        sock.sendall(encode_frame({"type": "INFER_REQUEST", "task_id": "t", "model": "tiny", "prompt": "Hi",
                                   "max_tokens": 2, "temperature": 0}))
        app.engine.gate.wait_arrived(1)
        time.sleep(1.5)  # three idle timeouts with a task running: the connection stays
        app.engine.gate.open()
        done = read_message(sock, parser)
        assert isinstance(done, m.TaskComplete), done
        start = time.monotonic()
        error = read_message(sock, parser)  # then nothing for idle_timeout_s: closed, and told why
        assert isinstance(error, m.ErrorMessage) and error.task_id is None
        assert error.error.code == "TIMEOUT" and error.error.details == {"idle_timeout_s": 0.5}
        assert read_message(sock, parser) is None
        assert 0.4 < time.monotonic() - start < 5
