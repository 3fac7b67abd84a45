"""MAGN frames against the real daemon on its socket (P1–P5, R1, R3)."""

from __future__ import annotations

import asyncio
import random
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest
from harness import RawPeer, running

from appliance.client import MagnClient
from appliance.engine.runtime import Generation, Token
from appliance.errors import ApplianceError
from appliance.protocol import messages as m
from appliance.protocol.frames import HEADER, MAGIC, encode_frame
from appliance.server.outcome import cancelled_error, error_of
from appliance.server.pump import TokenPump


@pytest.fixture
def model_dir(tmp_path: Path, tiny_model: Path) -> Path:
    folder = tmp_path / "models"
    folder.mkdir()
    shutil.copy(tiny_model, folder / "tiny.gguf")
    return folder


def test_streaming_delivers_tokens_then_a_completion_with_their_text(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir]) as app:
        peer = RawPeer(app.socket)
        peer.send({"type": "INFER_REQUEST", "task_id": "t1", "model": "tiny", "prompt": "Hello world",
                   "max_tokens": 12, "temperature": 0, "stream": True})
        got = peer.read_until_end("t1")
        tokens = [msg for msg in got if isinstance(msg, m.StreamToken)]
        done = got[-1]
        assert isinstance(done, m.TaskComplete)
        assert len(tokens) == done.usage.completion_tokens == 12 or done.stop_reason == "stop"
        assert done.text == "".join(t.text for t in tokens)
        assert done.usage.prompt_tokens == 3 and "elapsed_ms" in done.timings
        assert all(t.task_id == "t1" for t in tokens)
        peer.close()


def test_two_tasks_in_flight_on_one_connection_both_complete(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir]) as app:
        peer = RawPeer(app.socket)
        for task in ("a", "b"):
            peer.send({"type": "INFER_REQUEST", "task_id": task, "model": "tiny", "prompt": "Hi",
                       "max_tokens": 6, "temperature": 0})
        finished = {}
        while len(finished) < 2:
            msg = peer.read()
            if isinstance(msg, m.TaskComplete):
                finished[msg.task_id] = msg.text
        assert finished["a"] == finished["b"]  # same greedy request, same text
        peer.close()


def test_stalled_generation_sends_heartbeats(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir],
                 heartbeat_interval_s=0.1) as app:
        app.engine.delay_s = 0.35  # the harness's GatedEngine: each token stalls
        with MagnClient(str(app.socket), timeout=60) as client:
            completion = client.infer(model="tiny", prompt="Hi", max_tokens=3, temperature=0, stream=True)
            assert completion.usage.completion_tokens == 3
            assert client.heartbeats >= 3


def test_cancel_stops_generation_at_the_next_token(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir]) as app:
        app.engine.delay_s = 0.05
        peer = RawPeer(app.socket)
        peer.send({"type": "INFER_REQUEST", "task_id": "long", "model": "tiny", "prompt": "Hi",
                   "max_tokens": 400, "temperature": 0, "stream": True})
        first = peer.read_token()
        assert isinstance(first, m.StreamToken)
        start = time.monotonic()
        peer.send({"type": "CANCEL", "task_id": "long"})
        got = peer.read_until_end("long")
        assert time.monotonic() - start < 2  # not the 20 s the whole request would take
        end = got[-1]
        assert isinstance(end, m.ErrorMessage) and end.error.code == "CANCELLED"
        assert end.error.details["completion_tokens"] < 400
        assert app.daemon.models["tiny"].inflight == 0
        peer.close()


def test_client_disconnect_mid_stream_cancels_its_generation(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf"), "vram_bytes": "1GiB"}},
                 model_dirs=[model_dir]) as app:
        daemon = app.daemon
        app.engine.delay_s = 0.05
        peer = RawPeer(app.socket)
        peer.send({"type": "TASK_START", "task_id": "s", "session_id": "agent-x", "model": "tiny"})
        assert isinstance(peer.read(), m.TaskStart)
        peer.send({"type": "INFER_REQUEST", "task_id": "t", "session_id": "agent-x", "prompt": "Hi",
                   "max_tokens": 400, "stream": True})
        assert isinstance(peer.read_token(), m.StreamToken)
        peer.close()
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (daemon.agents or daemon.models["tiny"].inflight
                                               or daemon.ledger.allocated):  # the unload ends with the ledger
            time.sleep(0.05)
        # The session's agent belonged to the connection: nothing is left behind (R3).
        assert not daemon.agents and daemon.models["tiny"].inflight == 0
        assert daemon.ledger.allocated == 0 and daemon.models["tiny"].runtime is None
        assert not app.appliance.socket_server.connections


def test_protocol_errors_are_p4_frames(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir],
                 max_frame_bytes=4096) as app:
        peer = RawPeer(app.socket)
        peer.send({"type": "INFER_REQUEST", "task_id": "x", "model": "tiny", "prompt": "hi", "max_tokens": 0})
        err = peer.read()
        assert isinstance(err, m.ErrorMessage) and err.error.code == "BAD_PAYLOAD" and err.task_id == "x"
        peer.sock.sendall(HEADER.pack(MAGIC, 1, 8) + b"!!!!!!!!")  # framing intact, payload not base64
        assert peer.read().error.code == "BAD_PAYLOAD"
        peer.send({"type": "INFER_REQUEST", "task_id": "y", "model": "ghost", "prompt": "hi"})
        err = peer.read()
        assert err.error.code == "UNKNOWN_MODEL" and err.task_id == "y"
        peer.send({"type": "PROTOCOL_INFO"})  # the connection still works after recoverable errors
        assert isinstance(peer.read(), m.ProtocolInfo)
        peer.sock.sendall(HEADER.pack(MAGIC, 1, 5000))  # over max_frame_bytes: refused before any payload
        err = peer.read()
        assert err.error.code == "FRAME_TOO_LARGE"
        assert peer.sock.recv(10) == b""  # and the connection is closed
        peer.close()
        version = RawPeer(app.socket)
        version.sock.sendall(HEADER.pack(MAGIC, 2, 4) + b"e30=")
        assert version.read().error.code == "UNSUPPORTED_VERSION"
        assert version.sock.recv(10) == b""
        version.close()


def test_connection_129_is_refused_and_the_first_128_keep_working(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir]) as app:
        peers = [RawPeer(app.socket) for _ in range(128)]
        for peer in peers:
            peer.send({"type": "PROTOCOL_INFO"})
            assert isinstance(peer.read(), m.ProtocolInfo)
        extra = RawPeer(app.socket)
        extra.send({"type": "PROTOCOL_INFO"})
        refusal = extra.read()
        assert isinstance(refusal, m.ErrorMessage) and refusal.error.code == "TOO_MANY_CONNECTIONS"
        assert extra.sock.recv(10) == b""
        extra.close()
        line = socket.socket(socket.AF_UNIX)
        line.connect(str(app.socket))
        line.sendall(b"STATUS\n")
        assert line.recv(200).startswith(b"ERR TOO_MANY_CONNECTIONS")
        line.close()
        for peer in (peers[0], peers[64], peers[-1]):
            peer.send({"type": "INFER_REQUEST", "task_id": "t", "model": "tiny", "prompt": "Hi", "max_tokens": 2})
            assert isinstance(peer.read_until_end("t")[-1], m.TaskComplete)
        for peer in peers:
            peer.close()
        deadline = time.monotonic() + 5
        while len(app.appliance.socket_server.connections) and time.monotonic() < deadline:
            time.sleep(0.05)
        with MagnClient(str(app.socket), timeout=30) as client:  # room again once they left
            assert client.protocol_info().version == 1


def test_garbage_connections_never_disturb_a_well_behaved_client(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir]) as app:
        rng = random.Random(7)
        stop = threading.Event()
        results: list[str] = []
        failures: list[BaseException] = []

        def good_client() -> None:
            try:
                with MagnClient(str(app.socket), timeout=60) as client:
                    while not stop.is_set():
                        results.append(client.infer(model="tiny", prompt="Hello", max_tokens=4, temperature=0).text)
            except BaseException as exc:  # reported below
                failures.append(exc)

        worker = threading.Thread(target=good_client)
        worker.start()
        deadline = time.monotonic() + 60
        while not results and not failures and time.monotonic() < deadline:  # the model is loaded (trial first)
            time.sleep(0.01)
        before = len(results)
        magn = encode_frame({"type": "PROTOCOL_INFO"})
        i = 0
        while i < 2000 or (len(results) < before + 5 and time.monotonic() < deadline):  # served while it runs
            i += 1
            kind = i % 4
            if kind == 0:
                data = rng.randbytes(rng.randrange(1, 200))
            elif kind == 1:
                data = magn[:6] + rng.randbytes(rng.randrange(0, 64))  # MAGN header, garbage after
            elif kind == 2:
                cut = rng.randrange(1, len(magn))
                data = magn[:cut]  # truncated frame
            else:
                data = bytes([0x4D]) + rng.randbytes(rng.randrange(0, 40))
            with socket.socket(socket.AF_UNIX) as sock:
                sock.settimeout(10)
                sock.connect(str(app.socket))
                sock.sendall(data)
                sock.shutdown(socket.SHUT_WR)
                while sock.recv(65536):
                    pass
        stop.set()
        worker.join(60)
        assert not failures, failures
        assert len(results) >= before + 5 and len(set(results)) == 1  # identical greedy answers throughout
        with MagnClient(str(app.socket), timeout=30) as client:
            assert client.protocol_info().server == "appliance"


def test_client_library_raises_p4_errors(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir]) as app, \
            MagnClient(str(app.socket), timeout=30) as client:
        with pytest.raises(ApplianceError) as info:
            client.infer(session_id="nobody", prompt="x", max_tokens=2)
        assert info.value.code == "UNKNOWN_AGENT"
        client.start_task("s1", "tiny")
        first = client.infer(session_id="s1", prompt="Hello", max_tokens=4, temperature=0)
        second = client.infer(session_id="s1", prompt="", max_tokens=4, temperature=0)
        fresh = client.infer(model="tiny", prompt="Hello", max_tokens=8, temperature=0)
        assert first.text + second.text == fresh.text  # the session's conversation continued


def test_debug_logging_shows_each_frame_header_and_payload(model_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir]) as app:
        caplog.set_level("DEBUG", logger="appliance.server.magn")
        peer = RawPeer(app.socket)
        peer.send({"type": "PROTOCOL_INFO"})
        assert isinstance(peer.read(), m.ProtocolInfo)
        peer.close()
        length = len(encode_frame({"type": "PROTOCOL_INFO"})) - HEADER.size
        messages = [r.getMessage() for r in caplog.records if r.name == "appliance.server.magn"]
        assert f"MAGN in magic=0x4d474e54 version=1 length={length} {{'type': 'PROTOCOL_INFO'}}" in messages
        assert any(text.startswith("MAGN out magic=0x4d474e54 version=1 length=") and "'schema': 'magn/1'" in text
                   for text in messages)


def test_stopping_ends_running_tasks_with_shutting_down(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir],
                 shutdown_grace_s=0.5) as app:
        app.engine.delay_s = 0.05
        peer = RawPeer(app.socket)
        peer.send({"type": "INFER_REQUEST", "task_id": "long", "model": "tiny", "prompt": "Hi",
                   "max_tokens": 400, "stream": True})
        assert isinstance(peer.read_token(), m.StreamToken)
        app.line("REGISTER a tiny")
        line = socket.socket(socket.AF_UNIX)
        line.connect(str(app.socket))
        line.sendall(b"DECODE a 400 Hello\n")
        time.sleep(0.3)
        start = time.monotonic()
        app.call(app.appliance.stop())
        assert time.monotonic() - start < 5  # the 0.5 s grace, not the 20 s the requests would take
        end = peer.read_until_end("long")[-1]
        assert isinstance(end, m.ErrorMessage) and end.error.code == "SHUTTING_DOWN"
        assert line.recv(4096).startswith(b"ERR SHUTTING_DOWN")
        assert not app.socket.exists()
        peer.close()
        line.close()


# --- the conversation rules, as the server applies them -----------------------------------------------------------


def test_conversation_rules_on_the_server(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir]) as app:
        peer = RawPeer(app.socket)
        peer.send({"type": "CANCEL", "task_id": "nobody"})  # a late CANCEL: ignored, nothing answers it
        peer.send({"type": "HEARTBEAT", "task_id": "h"})  # a server-only type
        err = peer.read()
        assert isinstance(err, m.ErrorMessage) and err.task_id == "h" and err.error.code == "BAD_PAYLOAD"
        assert err.error.message == "HEARTBEAT is sent by the server, not to it"
        request = {"type": "INFER_REQUEST", "task_id": "d", "model": "tiny", "prompt": "Hi", "max_tokens": 3,
                   "temperature": 0}
        peer.send(request)
        peer.send(request)  # the same task_id while the first is in flight
        got = peer.read_until_end("d")
        refusal = got[-1]
        assert isinstance(refusal, m.ErrorMessage) and refusal.error.code == "BAD_REQUEST"
        assert refusal.error.message == "task_id already in flight on this connection"
        assert isinstance(peer.read_until_end("d")[-1], m.TaskComplete)  # the first one still completes
        peer.send({"type": "CANCEL", "task_id": "d"})  # it ended: this CANCEL is late
        peer.send({"type": "PROTOCOL_INFO"})
        assert isinstance(peer.read(), m.ProtocolInfo)
        peer.close()


def test_the_session_reads_its_settings_from_the_current_config(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir],
                 max_frame_bytes=4096) as app:
        peer = RawPeer(app.socket)
        peer.send({"type": "PROTOCOL_INFO"})
        assert peer.read().max_frame_bytes == 4096
        app.daemon.config = app.daemon.config.with_overrides(max_frame_bytes=1 << 20)  # a hot reload
        peer.send({"type": "PROTOCOL_INFO", "padding": "x" * 6000})  # over the old limit: read, then refused
        err = peer.read()
        assert isinstance(err, m.ErrorMessage) and err.error.code == "BAD_PAYLOAD"
        peer.send({"type": "PROTOCOL_INFO"})
        assert peer.read().max_frame_bytes == 1 << 20
        peer.close()


# --- the token pump and the outcome of a generation -------------------------------------------------------------------


def token(i: int) -> Token:
    return Token(i, f"w{i}", i, 1.0)


def test_the_pump_delivers_tokens_from_another_thread_in_batches_and_all_before_finish() -> None:
    async def main() -> list[list[int]]:
        batches: list[list[int]] = []

        def sink(got: list[Token]) -> bool:
            batches.append([t.id for t in got])
            return True

        cancel = threading.Event()
        pump = TokenPump(asyncio.get_running_loop(), sink, cancel=cancel)
        with pump:
            producer = threading.Thread(target=lambda: [pump.on_token(token(i)) for i in range(500)])
            producer.start()
            await asyncio.to_thread(producer.join)
        pump.on_token(token(999))  # after finish: dropped
        await asyncio.sleep(0.01)
        assert not cancel.is_set() and pump.delivered == 500
        return batches

    batches = asyncio.run(main())
    assert [i for batch in batches for i in batch] == list(range(500))


def test_the_pump_cancels_the_generation_once_the_sink_is_gone() -> None:
    async def main() -> tuple[list[int], threading.Event]:
        seen: list[int] = []

        def sink(got: list[Token]) -> bool:
            seen.extend(t.id for t in got)
            return False

        cancel = threading.Event()
        with TokenPump(asyncio.get_running_loop(), sink, cancel=cancel) as pump:
            pump.on_token(token(1))
            await asyncio.sleep(0.01)
            pump.on_token(token(2))
            await asyncio.sleep(0.01)
        return seen, cancel

    seen, cancel = asyncio.run(main())
    assert seen == [1] and cancel.is_set()


def test_the_pump_beats_when_tokens_stall_and_reads_the_interval_each_time() -> None:
    async def main() -> list[float]:
        beats: list[float] = []
        interval = [0.05]
        loop = asyncio.get_running_loop()
        with TokenPump(loop, lambda got: True, cancel=threading.Event(), heartbeat=lambda: beats.append(loop.time()),
                       heartbeat_interval_s=lambda: interval[0]):
            await asyncio.sleep(0.18)  # about 3 beats
            interval[0] = 10.0  # a reloaded config: no more beats soon
            count = len(beats)
            await asyncio.sleep(0.2)
            assert len(beats) <= count + 1
        await asyncio.sleep(0.1)  # finished: the timer is gone
        return beats

    beats = asyncio.run(main())
    assert 1 <= len(beats) <= 5


@pytest.mark.parametrize(("stop_reason", "closing", "code"), [
    ("cancelled", False, "CANCELLED"), ("cancelled", True, "SHUTTING_DOWN"), ("eos", True, None),
    ("length", False, None)])
def test_a_cancelled_generation_is_cancelled_or_shutting_down(stop_reason: str, closing: bool,
                                                              code: str | None) -> None:
    generation = Generation("ab", (1, 2), 3, stop_reason, 0.1, 0.01)  # type: ignore[arg-type]
    error = cancelled_error(generation, closing=closing)
    if code is None:
        assert error is None
    else:
        assert error is not None and error.code == code and error.details == {"completion_tokens": 2}


def test_error_of_keeps_appliance_errors_and_wraps_the_rest() -> None:
    known = ApplianceError("UNKNOWN_MODEL")
    assert error_of(known) is known
    wrapped = error_of(KeyError("secret /etc/shadow"))
    assert wrapped.code == "INTERNAL" and wrapped.message == "an unexpected internal error"
    assert not wrapped.retryable and "shadow" not in str(wrapped.to_dict())


def test_tasks_beyond_the_per_connection_limit_are_refused_and_the_connection_goes_on(model_dir: Path) -> None:
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir],
                 max_tasks_per_connection=1) as app:
        app.engine.gate.close()
        peer = RawPeer(app.socket)
        for task in ("first", "second"):
            peer.send({"type": "INFER_REQUEST", "task_id": task, "model": "tiny", "prompt": "Hi", "max_tokens": 3,
                       "temperature": 0})
        refused = peer.read_token()
        assert isinstance(refused, m.ErrorMessage) and refused.task_id == "second"
        assert refused.error.code == "TOO_MANY_TASKS" and refused.error.details == {"max_tasks_per_connection": 1}
        app.engine.gate.open()
        assert isinstance(peer.read_until_end("first")[-1], m.TaskComplete)
        peer.send({"type": "INFER_REQUEST", "task_id": "second", "model": "tiny", "prompt": "Hi", "max_tokens": 3,
                   "temperature": 0})  # its slot is free again, and the task_id may be reused
        assert isinstance(peer.read_until_end("second")[-1], m.TaskComplete)
        peer.close()


def test_a_client_that_leaves_right_after_its_reply_still_has_its_request_counted_and_logged(model_dir: Path) -> None:
    """TASK_COMPLETE is written as the request ends, before the daemon's bookkeeping: a client that closes its
    socket the moment it has its reply still has its request in the counters and the request log, as ok."""
    with running({"tiny": {"path": str(model_dir / "tiny.gguf")}}, model_dirs=[model_dir]) as app:
        for n in range(3):
            decodes = app.daemon.counters["decodes"]
            logged = len(app.daemon.requests)
            peer = RawPeer(app.socket)
            peer.send({"type": "INFER_REQUEST", "task_id": f"t{n}", "model": "tiny", "prompt": f"Hello {n}",
                       "max_tokens": 1, "temperature": 0})
            done = peer.read_token()
            peer.close()
            assert isinstance(done, m.TaskComplete) and done.usage.completion_tokens == 1
            deadline = time.monotonic() + 30
            while len(app.daemon.requests) == logged and time.monotonic() < deadline:
                time.sleep(0.01)
            assert app.daemon.counters["decodes"] == decodes + 1
            record = app.daemon.requests.recent(1)[0]
            assert (record.surface, record.outcome, record.generated_tokens) == ("magn", "ok", 1)
