"""One MAGN connection (SPEC P1–P5): frames in, daemon calls, frames out.

The codec is :mod:`appliance.protocol.frames` / :mod:`appliance.protocol.messages` (sans-IO); this is the IO shell. Several
tasks may run at once on one connection, each keyed by its client-chosen ``task_id``. A task that produces
no token for ``heartbeat_interval_s`` sends HEARTBEAT frames; CANCEL or the client going away stops its
generation at the next token.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field

from appliance import __version__
from appliance.protocol import messages as m
from appliance.daemon.core import Daemon, DecodeResult
from appliance.engine.runtime import Sampling, Token
from appliance.errors import ApplianceError, internal
from appliance.protocol.frames import HEADER, MAGIC, NEED_DATA, SUPPORTED_VERSIONS, VERSION, FrameParser, RemoteProtocolError
from appliance.server.peer import peer_gone
from appliance.engine.chat import render_chat

log = logging.getLogger(__name__)


def error_frame(error: ApplianceError, task_id: str | None) -> bytes:
    return m.encode_message(m.ErrorMessage.of(error, task_id))


@dataclass(eq=False)
class Task:
    request: m.InferRequest
    cancel: threading.Event = field(default_factory=threading.Event)
    job: asyncio.Task[None] | None = None


class MagnSession:
    def __init__(self, daemon: Daemon, writer: asyncio.StreamWriter) -> None:
        self.daemon = daemon
        self.writer = writer
        config = daemon.config
        self.max_frame_bytes = config.max_frame_bytes
        self.heartbeat_s = config.heartbeat_interval_s
        self.tasks: dict[str, Task] = {}

    def send(self, message: m.Message) -> None:
        data = m.encode_message(message)
        if log.isEnabledFor(logging.DEBUG):
            magic, version, length = HEADER.unpack_from(data)
            log.debug("MAGN out magic=%#x version=%d length=%d %s", magic, version, length, message.to_payload())
        if not self.writer.is_closing():
            self.writer.write(data)

    async def serve(self, reader: asyncio.StreamReader, initial: bytes) -> None:
        parser = FrameParser(self.max_frame_bytes)
        parser.receive_data(initial)
        try:
            while True:
                try:
                    event = parser.next_event()
                except RemoteProtocolError as exc:
                    self.send(m.ErrorMessage.of(exc.error, exc.task_id))
                    await self.writer.drain()
                    if exc.fatal:
                        return
                    continue
                if event is NEED_DATA:
                    chunk = await reader.read(1 << 16)
                    parser.receive_data(chunk)
                    if not chunk and peer_gone(self.writer):
                        return  # the client died: the finally below cancels its tasks (R3)
                    continue
                if not hasattr(event, "payload"):  # CLOSED: the client finished sending
                    await self._finish_tasks()
                    return
                if event.version not in SUPPORTED_VERSIONS:  # the parser refuses these; belt and braces
                    return
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("MAGN in magic=%#x version=%d length=%d %s", MAGIC, event.version, parser.last_length,
                              event.payload)
                try:
                    message = m.parse_message(event.payload)
                except RemoteProtocolError as exc:
                    self.send(m.ErrorMessage.of(exc.error, exc.task_id))
                    continue
                await self.dispatch(message)
                await self.writer.drain()
        finally:
            for task in self.tasks.values():
                task.cancel.set()
            await self._finish_tasks()

    async def _finish_tasks(self) -> None:
        jobs = [t.job for t in self.tasks.values() if t.job is not None]
        if jobs:
            await asyncio.gather(*jobs, return_exceptions=True)

    async def dispatch(self, message: m.Message) -> None:
        if isinstance(message, m.ProtocolInfoRequest):
            self.send(m.ProtocolInfo(VERSION, tuple(sorted(SUPPORTED_VERSIONS)), m.SCHEMA, self.max_frame_bytes,
                                     "appliance", __version__))
        elif isinstance(message, m.TaskStart):
            await self.start(message)
        elif isinstance(message, m.InferRequest):
            if message.task_id in self.tasks:
                self.send(m.ErrorMessage.of(ApplianceError(
                    "BAD_REQUEST", "task_id already in flight on this connection", {"task_id": message.task_id}),
                    message.task_id))
                return
            task = self.tasks[message.task_id] = Task(message)
            task.job = asyncio.create_task(self.infer(task))
        elif isinstance(message, m.Cancel):
            task = self.tasks.get(message.task_id)
            if task is not None:  # a CANCEL racing the task's end is ignored (the task already answered)
                task.cancel.set()
        else:
            self.send(m.ErrorMessage.of(ApplianceError(
                "BAD_PAYLOAD", f"{message.TYPE} is sent by the server, not to it", {"type": message.TYPE}),
                getattr(message, "task_id", None)))

    async def start(self, message: m.TaskStart) -> None:
        try:
            await self.daemon.register(message.session_id, message.model, owner=self.writer)
        except ApplianceError as exc:
            self.send(m.ErrorMessage.of(exc, message.task_id))
            return
        self.send(m.TaskStart(message.task_id, message.session_id, message.model, message.tools, "started"))

    async def infer(self, task: Task) -> None:
        request = task.request
        loop = asyncio.get_running_loop()
        pending: collections.deque[Token] = collections.deque()
        scheduled = False
        last = time.monotonic()

        def flush() -> None:  # on the loop: every token the engine produced so far, in one write
            nonlocal scheduled, last
            scheduled = False
            if pending:
                frames = []
                while pending:
                    token = pending.popleft()
                    frames.append(m.encode_message(m.StreamToken(request.task_id, token.text, token.id,
                                                                 token.timestamp)))
                if self.writer.is_closing():
                    task.cancel.set()  # nobody is listening any more: stop at the next token
                else:
                    self.writer.write(b"".join(frames))
                last = time.monotonic()

        def on_token(token: Token) -> None:  # called on the engine thread
            nonlocal scheduled
            pending.append(token)
            if not scheduled:
                scheduled = True
                loop.call_soon_threadsafe(flush)

        def beat() -> None:  # HEARTBEAT when no token came for the interval
            nonlocal last, timer
            now = time.monotonic()
            if now - last >= self.heartbeat_s:
                self.send(m.Heartbeat(request.task_id, time.time()))
                last = now
            timer = loop.call_at(loop.time() + self.heartbeat_s - (now - last), beat)

        timer = loop.call_later(self.heartbeat_s, beat)
        prompt = request.prompt if request.prompt is not None else render_chat(request.messages or ())
        sampling = Sampling(temperature=request.temperature, top_p=request.top_p, stop=request.stop)
        try:
            if request.session_id is not None:
                result = await self.daemon.decode(request.session_id, request.max_tokens, prompt, sampling,
                                                  on_token if request.stream else None, task.cancel)
            else:
                assert request.model is not None
                result = await self.daemon.complete(request.model, request.max_tokens, prompt, sampling,
                                                    on_token if request.stream else None, task.cancel)
            if result.generation.stop_reason == "cancelled":
                done = {"completion_tokens": result.generation.generated_tokens}
                if self.daemon.closing:
                    raise ApplianceError("SHUTTING_DOWN", "the appliance is stopping", done)
                raise ApplianceError("CANCELLED", "the task was cancelled", done)
            flush()
            self.send(completion(request.task_id, result))
        except ApplianceError as exc:
            self.send(m.ErrorMessage.of(exc, request.task_id))
        except Exception as exc:
            log.exception("MAGN task failed")
            self.send(m.ErrorMessage.of(internal(exc), request.task_id))
        finally:
            timer.cancel()
            self.tasks.pop(request.task_id, None)
            with contextlib.suppress(ConnectionError):
                await self.writer.drain()


STOP_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def completion(task_id: str, result: DecodeResult) -> m.TaskComplete:
    gen = result.generation
    timings = {"elapsed_ms": gen.elapsed_s * 1000}
    if gen.ttft_s is not None:
        timings["ttft_ms"] = gen.ttft_s * 1000
    return m.TaskComplete(task_id, gen.text, m.Usage(gen.prompt_tokens, gen.generated_tokens),
                          STOP_REASONS[gen.stop_reason], timings,
                          stats={"model": result.model, "kv_swap_evicted": result.evicted,
                                 "kv_swap_restored": result.restored})


async def serve_magn(daemon: Daemon, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     initial: bytes) -> None:
    await MagnSession(daemon, writer).serve(reader, initial)
