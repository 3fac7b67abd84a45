"""The MAGN client (sync and asyncio) against a tiny scripted server on a real Unix socket.

The blocking API's tests run twice: on ``MagnClient`` and on ``AsyncMagnClient`` driven through the same API
(:class:`AsyncDriven`), so the two clients are held to the same behaviour."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from appliance.client import AsyncMagnClient, AsyncTokenStream, Completion, MagnClient
from appliance.errors import ApplianceError
from appliance.protocol.frames import Frame, FrameParser, LocalProtocolError, RemoteProtocolError
from appliance.protocol.messages import (
    SCHEMA,
    Cancel,
    ErrorMessage,
    Heartbeat,
    InferRequest,
    Message,
    ProtocolInfo,
    ProtocolInfoRequest,
    StreamToken,
    TaskComplete,
    TaskStart,
    Usage,
    encode_message,
    parse_message,
)

INFO = ProtocolInfo(1, (1,), SCHEMA, 1 << 24, "fake", "0")
_T = TypeVar("_T")


def run(coro: Coroutine[Any, Any, _T]) -> _T:
    """``asyncio.run`` with a deadline, so that a routing bug fails the test instead of hanging it."""
    return asyncio.run(asyncio.wait_for(coro, 10))


class FakeServer:
    """Scripted by the prompt: "hang..." streams one token and waits for CANCEL, "tick..." sends a HEARTBEAT every
    50 ms until CANCEL, "fatal..." streams one token then a connection-level ERROR and closes, "defer..." is answered
    only after the next request, "stale..." is answered and then sent messages for no task in flight, "mixup..."
    streams one token then a TASK_START echo (against the rules), model "nope" gets UNKNOWN_MODEL, anything else
    echoes its words as tokens.
    ``mode``: "full" (connection-level ERROR, then close), "garbage" (not MAGN), "close" (close on first frame)."""

    def __init__(self, path: Path, mode: str = "normal") -> None:
        self.path, self.mode = str(path), mode
        self.received: list[Message] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.path)
        self.listener.listen()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        lock = threading.Lock()  # "tick" sends from a second thread

        def send(message: Message) -> None:
            with lock:
                conn.sendall(encode_message(message))

        with conn:
            if self.mode == "full":
                return send(ErrorMessage.of(ApplianceError("TOO_MANY_CONNECTIONS")))
            if self.mode == "garbage":
                return conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            parser, hanging, deferred = FrameParser(), set[str](), list[InferRequest]()
            while data := conn.recv(65536):
                parser.receive_data(data)
                while isinstance(event := parser.next_event(), Frame):
                    if self.mode == "close":
                        return None
                    message = parse_message(event.payload)
                    self.received.append(message)
                    if self._answer(send, message, hanging, deferred) == "close":
                        conn.shutdown(socket.SHUT_RDWR)
        return None

    def _answer(self, send: Callable[[Message], None], msg: Message, hanging: set[str],
                deferred: list[InferRequest]) -> str | None:
        if isinstance(msg, ProtocolInfoRequest):
            send(INFO)
        elif isinstance(msg, TaskStart):
            send(ErrorMessage.of(ApplianceError("AGENT_EXISTS"), msg.task_id) if msg.session_id == "dup"
                 else dataclasses.replace(msg, status="started"))
        elif isinstance(msg, Cancel) and msg.task_id in hanging:
            hanging.discard(msg.task_id)
            send(ErrorMessage.of(ApplianceError("CANCELLED"), msg.task_id))
        elif isinstance(msg, InferRequest):
            prompt = msg.prompt if msg.prompt is not None else msg.messages[-1].content  # type: ignore[index]
            if msg.model == "nope":
                send(ErrorMessage.of(ApplianceError("UNKNOWN_MODEL", "no model nope", {"model": "nope"}), msg.task_id))
            elif prompt.startswith("hang"):
                hanging.add(msg.task_id)
                send(Heartbeat(msg.task_id, time.time()))
                send(StreamToken(msg.task_id, "first", 1, time.time()))
            elif prompt.startswith("tick"):
                hanging.add(msg.task_id)
                threading.Thread(target=self._tick, args=(send, msg.task_id, hanging), daemon=True).start()
            elif prompt.startswith("fatal"):
                send(StreamToken(msg.task_id, "last", 1, time.time()))
                send(ErrorMessage.of(ApplianceError("SHUTTING_DOWN")))
                return "close"
            elif prompt.startswith("defer"):
                deferred.append(msg)
            elif prompt.startswith("stale"):  # the task's own messages after its end, and one for no task at all
                self._complete(send, msg)
                send(Heartbeat(msg.task_id, time.time()))
                send(StreamToken("ghost", "boo", 1, time.time()))
            elif prompt.startswith("mixup"):  # a TASK_START echo for an INFER_REQUEST: breaks the rules
                send(StreamToken(msg.task_id, "first", 1, time.time()))
                send(TaskStart(msg.task_id, "s", "m", status="started"))
            else:
                for request in [msg, *deferred]:
                    self._complete(send, request)
                deferred.clear()
        return None

    @staticmethod
    def _tick(send: Callable[[Message], None], task_id: str, hanging: set[str]) -> None:
        deadline = time.monotonic() + 5
        with contextlib.suppress(OSError):  # the connection may end first
            while task_id in hanging and time.monotonic() < deadline:
                send(Heartbeat(task_id, time.time()))
                time.sleep(0.05)

    @staticmethod
    def _complete(send: Callable[[Message], None], msg: InferRequest) -> None:
        words = (msg.prompt or "").split()
        send(Heartbeat(msg.task_id, 1.0))
        if msg.stream:
            for i, word in enumerate(words):
                send(StreamToken(msg.task_id, word, i, 1.0 + i, -0.5))
        send(TaskComplete(msg.task_id, " ".join(words), Usage(len(words), len(words)), "stop",
                          {"elapsed_ms": 2.0}, stats={"plan": "S"}))

    def wait_for(self, predicate: Callable[[list[Message]], bool]) -> bool:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            if predicate(self.received):
                return True
            time.sleep(0.01)
        return False


@pytest.fixture
def make_server(tmp_path: Path) -> Iterator[Callable[..., FakeServer]]:
    servers: list[FakeServer] = []

    def make(mode: str = "normal") -> FakeServer:
        servers.append(FakeServer(tmp_path / f"magn{len(servers)}.sock", mode))
        return servers[-1]

    yield make
    for server in servers:
        server.listener.close()


@pytest.fixture
def server(make_server: Callable[..., FakeServer]) -> FakeServer:
    return make_server()


class AsyncDriven:
    """``AsyncMagnClient`` behind ``MagnClient``'s blocking API: each call runs on a private event loop under
    ``timeout``; a stream's request is flushed at once, as ``MagnClient.stream`` sends it at once."""

    def __init__(self, path: str, *, timeout: float | None = None) -> None:
        self.timeout, self.runner = timeout, asyncio.Runner()
        try:
            self.client = self.call(AsyncMagnClient(path).connect())
        except BaseException:
            self.runner.close()
            raise

    def call(self, coro: Coroutine[Any, Any, _T]) -> _T:
        async def bounded() -> _T:
            async with asyncio.timeout(self.timeout):
                return await coro

        return self.runner.run(bounded())

    def __getattr__(self, name: str) -> Any:  # heartbeats, and the coroutine methods as blocking ones
        attr = getattr(self.client, name)
        return (lambda *args, **kw: self.call(attr(*args, **kw))) if inspect.iscoroutinefunction(attr) else attr

    def __enter__(self) -> AsyncDriven:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def stream(self, **request: Any) -> DrivenStream:
        tokens = self.client.stream(**request)
        self.call(self.client._flush())
        return DrivenStream(self, tokens)


class DrivenStream:
    """An ``AsyncTokenStream`` iterated through :class:`AsyncDriven`."""

    def __init__(self, driven: AsyncDriven, tokens: AsyncTokenStream) -> None:
        self.driven, self.tokens = driven, tokens

    def __getattr__(self, name: str) -> Any:  # task_id, completion
        return getattr(self.tokens, name)

    def __iter__(self) -> DrivenStream:
        return self

    def __next__(self) -> StreamToken:
        try:
            return self.driven.call(self.tokens.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def close(self) -> None:
        self.tokens.close()
        self.driven.call(self.driven.client._flush())


Client = MagnClient | AsyncDriven


@pytest.fixture(params=["MagnClient", "AsyncMagnClient"])
def connect(request: pytest.FixtureRequest) -> Iterator[Callable[..., Client]]:
    """Opens a client of the kind under test: ``connect(path, timeout=...)``."""
    opened: list[AsyncDriven] = []

    def make(path: str, *, timeout: float | None = None) -> Client:
        if request.param == "MagnClient":
            return MagnClient(path, timeout=timeout)
        opened.append(AsyncDriven(path, timeout=timeout))
        return opened[-1]

    yield make
    for driven in opened:
        driven.runner.close()


@pytest.fixture
def client(server: FakeServer, connect: Callable[..., Client]) -> Iterator[Client]:
    with connect(server.path, timeout=5) as c:
        yield c


# --- the blocking API, on both clients --------------------------------------------------------------------------------


def test_protocol_info(client: Client, server: FakeServer) -> None:
    assert client.protocol_info() == INFO
    assert server.received == [ProtocolInfoRequest()]


def test_infer_returns_a_completion_and_consumes_heartbeats(client: Client) -> None:
    result = client.infer(model="m", prompt="a b c", max_tokens=8)
    assert result == Completion(result.task_id, "a b c", Usage(3, 3), {"elapsed_ms": 2.0}, "stop",
                                stats={"plan": "S"}, tokens=())
    assert client.heartbeats == 1


def test_infer_with_stream_keeps_the_tokens(client: Client, server: FakeServer) -> None:
    result = client.infer(model="m", prompt="x y", stream=True, task_id="mine", stop=["\n"])
    assert result.task_id == "mine" and [t.text for t in result.tokens] == ["x", "y"]
    request = server.received[0]
    assert isinstance(request, InferRequest) and request.stream and request.stop == ("\n",)


def test_stream_yields_tokens_then_has_the_completion(client: Client) -> None:
    stream = client.stream(session_id="agent", messages=[{"role": "user", "content": "ignored"}])
    assert list(stream) == [] and stream.completion is not None  # the fake server echoes only prompts
    stream = client.stream(model="m", prompt="one two three")
    tokens = list(stream)
    assert [t.text for t in tokens] == ["one", "two", "three"] and all(isinstance(t, StreamToken) for t in tokens)
    assert stream.completion is not None and stream.completion.text == "one two three"
    assert stream.completion.tokens == tuple(tokens) and client.heartbeats == 2
    assert list(stream) == []


def test_server_error_is_an_appliance_error_and_the_connection_goes_on(client: Client) -> None:
    with pytest.raises(ApplianceError) as info:
        client.infer(model="nope", prompt="x")
    assert info.value.code == "UNKNOWN_MODEL" and info.value.details == {"model": "nope"}
    assert client.infer(model="m", prompt="ok").text == "ok"


def test_start_task(client: Client) -> None:
    echo = client.start_task("agent-1", "qwen", tools=[{"name": "search"}])
    assert echo.status == "started" and echo.session_id == "agent-1" and echo.tools == [{"name": "search"}]
    with pytest.raises(ApplianceError, match="AGENT_EXISTS"):
        client.start_task("dup", "qwen")


def test_cancel_a_running_stream(client: Client, server: FakeServer) -> None:
    stream = client.stream(model="m", prompt="hang on")
    assert next(stream).text == "first"
    client.cancel(stream.task_id)
    with pytest.raises(ApplianceError) as info:
        next(stream)
    assert info.value.code == "CANCELLED"
    assert client.heartbeats == 1
    assert Cancel(stream.task_id) in server.received


def test_closing_a_stream_early_cancels_its_task(client: Client, server: FakeServer) -> None:
    stream = client.stream(model="m", prompt="hang")
    next(stream)
    stream.close()
    assert server.wait_for(lambda got: Cancel(stream.task_id) in got)
    assert client.protocol_info() == INFO  # the late ERROR CANCELLED is dropped


def test_interleaved_streams_are_routed_by_task_id(client: Client) -> None:
    first = client.stream(model="m", prompt="defer me")
    second = client.stream(model="m", prompt="a b")
    assert [t.text for t in second] == ["a", "b"]
    assert [t.text for t in first] == ["defer", "me"]
    assert first.completion is not None and first.completion.task_id == first.task_id != second.task_id


def test_timeout_cancels_the_task_and_keeps_the_connection(server: FakeServer, connect: Callable[..., Client]) -> None:
    with connect(server.path, timeout=0.3) as client:
        with pytest.raises(TimeoutError):
            client.infer(model="m", prompt="hang")
        task_id = server.received[0].task_id  # type: ignore[union-attr]
        assert server.wait_for(lambda got: Cancel(task_id) in got)
        assert client.protocol_info() == INFO


def test_an_invalid_request_is_refused_before_sending(client: Client, server: FakeServer) -> None:
    with pytest.raises(LocalProtocolError) as info:
        client.infer(model="m", prompt="x", temperature=5)
    assert info.value.error.details["field"] == "temperature"
    with pytest.raises(TypeError):
        client.infer(model="m", prompt="x", temprature=1)
    with pytest.raises(ValueError, match="in flight"):
        client.stream(model="m", prompt="hang", task_id="same")
        client.stream(model="m", prompt="hang", task_id="same")
    assert client.protocol_info() == INFO  # the server has read everything sent before this
    assert server.received == [InferRequest("same", model="m", prompt="hang", stream=True), ProtocolInfoRequest()]


def test_a_connection_level_error_fails_every_call(make_server: Callable[..., FakeServer],
                                                   connect: Callable[..., Client]) -> None:
    with connect(make_server("full").path, timeout=5) as client:
        for _ in range(2):
            with pytest.raises(ApplianceError) as info:
                client.protocol_info()
            assert info.value.code == "TOO_MANY_CONNECTIONS"


def test_a_server_that_does_not_speak_magn(make_server: Callable[..., FakeServer],
                                           connect: Callable[..., Client]) -> None:
    with connect(make_server("garbage").path, timeout=5) as client, pytest.raises(RemoteProtocolError) as info:
        client.protocol_info()
    assert info.value.code == "BAD_MAGIC"


def test_the_server_closing_the_connection(make_server: Callable[..., FakeServer],
                                           connect: Callable[..., Client]) -> None:
    with connect(make_server("close").path, timeout=5) as client:
        with pytest.raises(ConnectionError):
            client.infer(model="m", prompt="x")
        with pytest.raises(ConnectionError):
            client.protocol_info()


def test_connecting_to_nothing_and_closing_twice(tmp_path: Path, server: FakeServer,
                                                 connect: Callable[..., Client]) -> None:
    with pytest.raises(OSError):
        connect(str(tmp_path / "absent.sock"))
    client = connect(server.path)
    client.close()
    client.close()
    with pytest.raises(ConnectionError, match="closed"):
        client.protocol_info()


def test_a_stream_left_open_keeps_its_messages_while_other_calls_run(client: Client) -> None:
    stream = client.stream(model="m", prompt="defer x y")
    assert client.infer(model="m", prompt="a").text == "a"  # the server answers the deferred stream right after
    assert client.protocol_info() == INFO
    assert client.start_task("s", "m").status == "started"
    assert [t.text for t in stream] == ["defer", "x", "y"]
    assert stream.completion is not None and stream.completion.text == "defer x y" and client.heartbeats == 2


def test_a_long_stream_arrives_whole_and_in_order(client: Client) -> None:
    words = [f"w{i}" for i in range(3000)]  # far more than one read: frames are split across reads
    result = client.infer(model="m", prompt=" ".join(words), stream=True)
    assert [t.text for t in result.tokens] == words and [t.token_id for t in result.tokens] == list(range(3000))


def test_the_timeout_bounds_the_whole_call_not_each_message(server: FakeServer,
                                                            connect: Callable[..., Client]) -> None:
    with connect(server.path, timeout=0.3) as client:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            client.infer(model="m", prompt="tick")  # a HEARTBEAT every 50 ms, never a result
        assert time.monotonic() - start < 2 and client.heartbeats >= 3
        task_id = server.received[0].task_id  # type: ignore[union-attr]
        assert server.wait_for(lambda got: Cancel(task_id) in got)
        assert client.protocol_info() == INFO


def test_a_stream_step_that_times_out_cancels_the_task(server: FakeServer, connect: Callable[..., Client]) -> None:
    with connect(server.path, timeout=0.3) as client:
        stream = client.stream(model="m", prompt="hang")
        assert next(stream).text == "first"
        with pytest.raises(TimeoutError):
            next(stream)
        assert server.wait_for(lambda got: Cancel(stream.task_id) in got)
        assert list(stream) == [] and stream.completion is None
        assert client.protocol_info() == INFO


def test_a_connection_level_error_after_a_token(client: Client) -> None:
    stream = client.stream(model="m", prompt="fatal")
    assert next(stream).text == "last"  # received before the error: still delivered
    for call in (lambda: next(stream), client.protocol_info, lambda: client.infer(model="m", prompt="x")):
        with pytest.raises(ApplianceError, match="SHUTTING_DOWN"):
            call()


def test_what_the_server_said_before_it_closed_beats_the_failed_send(make_server: Callable[..., FakeServer],
                                                                     connect: Callable[..., Client]) -> None:
    with connect(make_server("full").path, timeout=5) as client:
        time.sleep(0.2)  # the server has sent its ERROR and closed: the next send fails (EPIPE)
        with pytest.raises(ApplianceError, match="TOO_MANY_CONNECTIONS"):
            client.infer(model="m", prompt="x")


def test_messages_for_no_task_in_flight_are_dropped(client: Client) -> None:
    assert client.infer(model="m", prompt="stale words").text == "stale words"
    assert client.protocol_info() == INFO  # the late HEARTBEAT and the ghost's token did not disturb anything
    assert client.heartbeats == 1


def test_a_rule_broken_for_one_task_fails_that_task_only(client: Client, server: FakeServer) -> None:
    stream = client.stream(model="m", prompt="mixup")
    assert next(stream).text == "first"
    with pytest.raises(RemoteProtocolError) as info:
        next(stream)
    assert info.value.code == "BAD_REQUEST" and info.value.task_id == stream.task_id and not info.value.fatal
    assert list(stream) == [] and stream.completion is None
    assert client.infer(model="m", prompt="still fine").text == "still fine"
    assert server.wait_for(lambda got: Cancel(stream.task_id) in got)  # the task was abandoned


# --- asyncio client -----------------------------------------------------------------------------------------------


def test_async_concurrent_calls_are_routed_by_task_id(server: FakeServer) -> None:
    async def main() -> tuple[Completion, Completion, ProtocolInfo]:
        async with AsyncMagnClient(server.path) as client:
            deferred = asyncio.create_task(client.infer(model="m", prompt="defer x", stream=True))
            await asyncio.sleep(0.05)  # the deferred request reaches the server first
            plain = await client.infer(model="m", prompt="y z")  # answered first, then the deferred one
            return await deferred, plain, await client.protocol_info()

    deferred, plain, info = run(main())
    assert deferred.text == "defer x" and [t.text for t in deferred.tokens] == ["defer", "x"]
    assert plain.text == "y z" and plain.tokens == () and info == INFO


def test_async_stream_heartbeats_and_start_task(server: FakeServer) -> None:
    async def main() -> None:
        async with AsyncMagnClient(server.path) as client:
            stream = client.stream(model="m", prompt="p q")
            assert [t.text async for t in stream] == ["p", "q"]
            assert stream.completion is not None and client.heartbeats == 1
            assert (await client.start_task("s", "m")).status == "started"
            with pytest.raises(ApplianceError, match="UNKNOWN_MODEL"):
                await client.infer(model="nope", prompt="x")

    run(main())


def test_async_cancelling_the_waiter_cancels_the_task(server: FakeServer) -> None:
    async def main() -> None:
        async with AsyncMagnClient(server.path) as client:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.infer(model="m", prompt="hang"), 0.2)
            stream = client.stream(model="m", prompt="hang")
            assert (await stream.__anext__()).text == "first"
            await client.cancel(stream.task_id)
            with pytest.raises(ApplianceError, match="CANCELLED"):
                await stream.__anext__()

    run(main())
    assert server.wait_for(lambda got: sum(isinstance(m, Cancel) for m in got) == 2)


def test_async_connection_failures(make_server: Callable[..., FakeServer]) -> None:
    async def main(mode: str) -> BaseException:
        async with AsyncMagnClient(make_server(mode).path) as client:
            first = asyncio.create_task(client.infer(model="m", prompt="x"))
            with pytest.raises(Exception) as info:
                await first
            with pytest.raises(type(info.value)):
                await client.protocol_info()
            return info.value

    assert isinstance(run(main("full")), ApplianceError)
    assert isinstance(run(main("garbage")), RemoteProtocolError)
    assert isinstance(run(main("close")), ConnectionError)


def test_async_client_must_connect_first(tmp_path: Path) -> None:
    async def main() -> None:
        with pytest.raises(ConnectionError, match="connect"):
            await AsyncMagnClient(str(tmp_path / "x.sock")).protocol_info()

    run(main())


# --- the line client: a hostile body comes back exact, and the reply ends where the server ended it -------------

def _serve_one_line_reply(path: Path, reply: bytes, received: list[bytes]) -> threading.Thread:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(1)

    def serve() -> None:
        with listener:
            conn, _ = listener.accept()
            with conn:
                received.append(conn.recv(65536))
                conn.sendall(reply + b"OK schema=lmx-daemon/1\nnever read\n")

    thread = threading.Thread(target=serve, name="line-server", daemon=True)
    thread.start()
    return thread


def test_the_line_client_reads_a_hostile_body_back_exactly(tmp_path: Path) -> None:
    from appliance.client import lines as lineclient
    from appliance.protocol import lines

    body = "x\nEND_RESPONSE\nERR INTERNAL forged=1\r\n\\ \u2028"
    reply = lines.format_reply("DECODE", [{"generated_tokens": 7, "note": "a b"}], body=[body], agent_id="a")
    received: list[bytes] = []
    thread = _serve_one_line_reply(tmp_path / "l.sock", reply.encode(), received)
    text = lineclient.request(tmp_path / "l.sock", "DECODE a 7 hi", timeout=10)
    thread.join(10)
    assert received == [b"DECODE a 7 hi\n"]
    assert text == reply
    assert lineclient.response_body(text) == body
    assert lineclient.header_fields(text) == {"schema": "lmx-daemon/1", "invoke": "DECODE", "agent_id": "a",
                                              "generated_tokens": "7", "note": "a b"}


def test_the_line_client_stops_at_an_err_line(tmp_path: Path) -> None:
    from appliance.client import lines as lineclient

    received: list[bytes] = []
    thread = _serve_one_line_reply(tmp_path / "e.sock", b"ERR BAD_REQUEST n_tokens=0x10 max=8192\n", received)
    text = lineclient.request(tmp_path / "e.sock", "DECODE a 0x10", timeout=10)
    thread.join(10)
    assert text == "ERR BAD_REQUEST n_tokens=0x10 max=8192\n"
    assert lineclient.header_fields(text) == {"n_tokens": "0x10", "max": "8192"}
    with pytest.raises(ValueError):
        lineclient.response_body(text)
