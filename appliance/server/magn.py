"""The server side of one MAGN connection (SPEC P1–P5): bytes in, daemon calls, bytes out.

The conversation rules (framing, who sends what, tasks in flight, duplicate ``task_id``, late CANCEL) are the sans-IO
:class:`~appliance.protocol.connection.Connection`; how a generation ends is :mod:`appliance.server.outcome`; the
streaming of its tokens and heartbeats is :class:`~appliance.server.pump.TokenPump`. This module is the IO shell
that joins them to the socket and the daemon.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import threading
import time
from dataclasses import dataclass, field

from appliance import __version__
from appliance.daemon.core import Daemon, DecodeResult
from appliance.engine.chat import render_chat
from appliance.engine.interface import Sampling, Token
from appliance.errors import ApplianceError
from appliance.protocol import messages as m
from appliance.protocol.connection import CLOSED, NEED_DATA, SERVER, Connection, Event
from appliance.protocol.frames import HEADER, MAGIC, SUPPORTED_VERSIONS, VERSION, Frame, RemoteProtocolError
from appliance.server.outcome import error_of, generate
from appliance.server.peer import ReadClock, flush_within, peer_gone, read_within, socket_settings, unread_bytes
from appliance.server.pump import TokenPump

log = logging.getLogger(__name__)

READ_BYTES = 1 << 16
OFF_LOOP_FRAME_BYTES = 256 * 1024
"""Frames longer than this are decoded (base64, JSON) on a worker thread."""


def error_frame(error: ApplianceError, task_id: str | None) -> bytes:
    """An ERROR frame outside any session (the listener refusing a connection)."""
    return m.encode_message(m.ErrorMessage.of(error, task_id))


@dataclass(eq=False)
class Task:
    """One INFER_REQUEST in flight: its request, the event that stops its generation, and the job running it."""

    request: m.InferRequest
    cancel: threading.Event = field(default_factory=threading.Event)
    job: asyncio.Task[None] | None = None


class MagnSession:
    """One client's MAGN connection on the server.

    It owns the :class:`~appliance.protocol.connection.Connection` (SERVER role: the parser, the rules, the tasks in
    flight), the :class:`Task` (job and cancel event) of each INFER_REQUEST in flight, keyed by ``task_id``, and the
    writing side of the socket; the agents it registers with TASK_START are owned by ``writer`` in the daemon (the
    listener releases them when the connection ends). It owns no configuration: ``max_frame_bytes`` and
    ``heartbeat_interval_s`` are read from ``daemon.config`` when used, so a reloaded config applies at once.

    Several tasks may run at once, each an asyncio job, at most ``max_tasks_per_connection`` (more are refused with
    TOO_MANY_TASKS, the connection goes on); CANCEL, the client going away or the session ending sets the task's
    cancel event, which stops its generation at the next token.

    Bounds: a frame once started must arrive whole within ``socket.request_timeout_s`` and a connection with no task
    and no bytes for ``socket.idle_timeout_s`` is closed (:class:`~appliance.server.peer.ReadClock`; both with an
    ERROR TIMEOUT); a frame above :data:`OFF_LOOP_FRAME_BYTES` is parsed on a worker thread, not on the event
    loop; a stream whose client does not read pauses its generation and ends with TIMEOUT after
    ``socket.stall_timeout_s`` (:class:`~appliance.server.pump.TokenPump`).
    """

    def __init__(self, daemon: Daemon, writer: asyncio.StreamWriter) -> None:
        self.daemon = daemon
        self.writer = writer
        self.conn = Connection(SERVER, max_frame_bytes=daemon.config.max_frame_bytes, on_frame=self._log_in)
        self.tasks: dict[str, Task] = {}
        self.clock = ReadClock(functools.partial(socket_settings, daemon))
        self._parsing = False  # a worker thread is in self.conn.next_event(): hold what we send
        self._held: list[m.Message] = []

    def _stall_timeout_s(self) -> float:
        return self.daemon.config.socket.stall_timeout_s

    # -- sending ----------------------------------------------------------------------------------------------------

    def encode(self, message: m.Message) -> bytes:
        """``message``'s frame, checked by the connection's rules (and logged at DEBUG)."""
        data = self.conn.send(message)
        if isinstance(message, m.ErrorMessage):
            self.daemon.errors["magn", message.error.code] += 1
        if log.isEnabledFor(logging.DEBUG):
            magic, version, length = HEADER.unpack_from(data)
            log.debug("MAGN out magic=%#x version=%d length=%d %s", magic, version, length, message.to_payload())
        return data

    def send(self, message: m.Message) -> None:
        """Encode and write ``message``; while a worker thread parses a frame (the connection is its own for that
        time) the message is held, and sent in order as soon as the thread is done."""
        if self._parsing:
            self._held.append(message)
            return
        data = self.encode(message)
        if not self.writer.is_closing():
            self.writer.write(data)

    def _release_held(self) -> None:
        held = self._held
        self._held = []
        for message in held:
            self.send(message)

    @staticmethod
    def _log_in(frame: Frame, length: int) -> None:
        if log.isEnabledFor(logging.DEBUG):
            log.debug("MAGN in magic=%#x version=%d length=%d %s", MAGIC, frame.version, length, frame.payload)

    # -- receiving --------------------------------------------------------------------------------------------------

    async def serve(self, reader: asyncio.StreamReader, initial: bytes) -> None:
        """Read and answer messages until the client ends its stream, goes away, or breaks the framing."""
        if initial:
            self.conn.receive_data(initial)
        try:
            while True:
                self.conn.max_frame_bytes = self.daemon.config.max_frame_bytes
                try:
                    event = await self.next_event()
                except RemoteProtocolError as exc:
                    self.clock.pending(False)
                    self.send(m.ErrorMessage.of(exc.error, exc.task_id))
                    if not await self.flush() or exc.fatal:
                        return
                    continue
                if event is NEED_DATA:
                    self.clock.pending(self.conn.buffered_bytes > 0)
                    chunk = await read_within(reader, self.clock, READ_BYTES)
                    if chunk is None:
                        self.send(m.ErrorMessage.of(self.clock.error("frame"), None))
                        await self.flush()
                        return
                    self.conn.receive_data(chunk)
                    if not chunk and peer_gone(self.writer):
                        return  # the client died: the finally below cancels its tasks (R3)
                    continue
                self.clock.pending(False)
                if event is CLOSED:  # the client finished sending: answer what it asked, then end
                    await self._finish_tasks()
                    return
                await self.dispatch(event)
                if not await self.flush():
                    return
        finally:
            for task in self.tasks.values():
                task.cancel.set()
            await self._finish_tasks()

    async def next_event(self) -> Event:
        """The connection's next event; a big frame is decoded on a worker thread so that the loop never waits
        on it (meanwhile :meth:`send` holds what the loop sends: the connection is not shared between threads)."""
        size = self.conn.pending_frame_bytes
        if size > OFF_LOOP_FRAME_BYTES and self.conn.buffered_bytes >= size:
            self._parsing = True
            try:
                return await asyncio.to_thread(self.conn.next_event)
            finally:
                self._parsing = False
                self._release_held()
        return self.conn.next_event()

    async def flush(self) -> bool:
        """Wait until the transport took what we wrote; False (connection aborted) if the client stopped reading."""
        return await flush_within(self.writer, self._stall_timeout_s())

    async def _finish_tasks(self) -> None:
        jobs = [t.job for t in self.tasks.values() if t.job is not None]
        if jobs:
            await asyncio.gather(*jobs, return_exceptions=True)

    async def dispatch(self, message: m.Message) -> None:
        """Act on one message the connection accepted (so a client-to-server type, within the rules)."""
        if isinstance(message, m.ProtocolInfoRequest):
            self.send(m.ProtocolInfo(VERSION, tuple(sorted(SUPPORTED_VERSIONS)), m.SCHEMA,
                                     self.daemon.config.max_frame_bytes, "appliance", __version__))
        elif isinstance(message, m.TaskStart):
            await self.start(message)
        elif isinstance(message, m.InferRequest):
            limit = self.daemon.config.max_tasks_per_connection
            if len(self.tasks) >= limit:
                self.send(m.ErrorMessage.of(ApplianceError(
                    "TOO_MANY_TASKS", f"at most {limit} tasks in flight on one connection",
                    {"max_tasks_per_connection": limit}), message.task_id))
                return
            task = Task(message)
            self.tasks[message.task_id] = task
            self.clock.busy(True)
            task.job = asyncio.create_task(self.infer(task))
        elif isinstance(message, m.Cancel):
            task = self.tasks.get(message.task_id)  # the connection drops late CANCELs: this is a task in flight
            if task is not None:
                task.cancel.set()

    async def start(self, message: m.TaskStart) -> None:
        try:
            await self.daemon.register(message.session_id, message.model, owner=self.writer)
        except ApplianceError as exc:
            self.send(m.ErrorMessage.of(exc, message.task_id))
            return
        self.send(m.TaskStart(message.task_id, message.session_id, message.model, message.tools, "started"))

    # -- one INFER_REQUEST ------------------------------------------------------------------------------------------

    async def infer(self, task: Task) -> None:
        request = task.request
        task_id = request.task_id
        pump = TokenPump(asyncio.get_running_loop(), functools.partial(self._deliver, task_id), cancel=task.cancel,
                         heartbeat=functools.partial(self._heartbeat, task_id),
                         heartbeat_interval_s=self._heartbeat_interval_s,
                         backlog=functools.partial(unread_bytes, self.writer), stall_timeout_s=self._stall_timeout_s)
        prompt = request.prompt if request.prompt is not None else render_chat(request.messages or ())
        sampling = Sampling(temperature=request.temperature, top_p=request.top_p, stop=request.stop)
        try:
            try:
                with pump:  # on exit every token is delivered: nothing can follow the end
                    result = await generate(self.daemon, surface="magn", prompt=prompt, max_tokens=request.max_tokens,
                                            sampling=sampling, session_id=request.session_id, model=request.model,
                                            on_token=pump.on_token if request.stream else None, cancel=task.cancel,
                                            queue=("connection", id(self)))
                end: m.Message = completion(task_id, result)
            except Exception as exc:
                end = m.ErrorMessage.of(self.stall_error(exc) if pump.stalled else error_of(exc), task_id)
            self.send(end)
        finally:
            self.tasks.pop(task_id, None)
            self.clock.busy(bool(self.tasks))
            with contextlib.suppress(ConnectionError):
                await self.flush()

    def stall_error(self, exc: Exception) -> ApplianceError:
        """The TIMEOUT for a stream cancelled because its client read nothing for ``socket.stall_timeout_s``."""
        stall = self._stall_timeout_s()
        details: dict[str, object] = {"stall_timeout_s": stall}
        if isinstance(exc, ApplianceError) and "completion_tokens" in exc.details:
            details["completion_tokens"] = exc.details["completion_tokens"]
        return ApplianceError("TIMEOUT", f"the client read nothing of its stream for {stall:g} s", details)

    def _deliver(self, task_id: str, tokens: list[Token]) -> bool:
        """The pump's sink: one write of STREAM_TOKEN frames; False once the client is gone."""
        if self.writer.is_closing():
            return False
        messages = [m.StreamToken(task_id, token.text, token.id, token.timestamp) for token in tokens]
        if self._parsing:
            self._held.extend(messages)
            return True
        frames = [self.encode(message) for message in messages]
        self.writer.write(b"".join(frames))
        return True

    def _heartbeat(self, task_id: str) -> None:
        self.send(m.Heartbeat(task_id, time.time()))

    def _heartbeat_interval_s(self) -> float:
        return self.daemon.config.heartbeat_interval_s


STOP_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def completion(task_id: str, result: DecodeResult) -> m.TaskComplete:
    """The TASK_COMPLETE of a finished generation (SPEC E6): its times in ``timings`` (``ttft_ms`` left out when
    no token was generated), its peak memory, plan and threads in ``stats``."""
    gen = result.generation
    timings = {"elapsed_ms": gen.elapsed_s * 1000}
    if gen.ttft_s is not None:
        timings["ttft_ms"] = gen.ttft_s * 1000
    stats: dict[str, object] = {"model": result.model, "kv_swap_evicted": result.evicted,
                                "kv_swap_restored": result.restored, "peak_memory_bytes": result.peak_memory_bytes,
                                "plan": result.plan, "threads": result.threads}
    if gen.prompt_evaluated is not None:  # tokens evaluated before the first new one (shared prefixes skip some)
        stats["prompt_evaluated"] = gen.prompt_evaluated
    if result.notice is not None:  # once: its model was reloaded with another vocabulary
        stats["notice"] = result.notice
    return m.TaskComplete(task_id, gen.text, m.Usage(gen.prompt_tokens, gen.generated_tokens),
                          STOP_REASONS[gen.stop_reason], timings, stats=stats)


async def serve_magn(daemon: Daemon, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     initial: bytes) -> None:
    await MagnSession(daemon, writer).serve(reader, initial)
