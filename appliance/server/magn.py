"""The server side of one MAGN connection (SPEC P1–P5): bytes in, daemon calls, bytes out.

The conversation rules (framing, who sends what, tasks in flight, duplicate ``task_id``, late CANCEL) are the sans-IO
:class:`~appliance.protocol.connection.Connection`; how a generation ends is :mod:`appliance.server.outcome`; the
streaming of its tokens is :class:`~appliance.server.pump.TokenPump`; which requests owe a heartbeat is
:mod:`appliance.server.heartbeat` (one timer per connection, not one per request). This module is the IO shell that
joins them to the socket and the daemon.

Chat (the same machinery as the OpenAI API's): an INFER_REQUEST's ``messages`` are rendered with the model's chat
template into a :class:`~appliance.engine.interface.Prompt` (control tokens from the template only, never from a
message's text; :func:`appliance.engine.chat.render_prompt`), with the tools its session was started with (TASK_START
``tools``, checked by :func:`appliance.engine.toolcalls.parse_tools`) unless ``tool_choice`` is ``none``. With a
session the messages are its whole history (the conversation keeps what it holds of them and evaluates the rest);
without one they start a fresh conversation. A ``prompt`` is raw text: no template, no control tokens, no tools.

Tool calls (:func:`plan_chat`, :func:`completion`): with tools in play the output is constrained by the grammar of
the template's call format (``tool_choice``: ``auto`` lazy, ``required`` or a named function from the first token)
to ONE call per answer, and parsed: an answer that made its call and ended (the grammar's end, then the end of turn)
ends with ``stop_reason: "tool_call"`` and the call (its ``id``, ``name`` and ``arguments``) in ``tool_call``;
``text`` is the answer's text outside the call. An answer cut short inside its call (``max_tokens``, the context's
end, a stop string), or whose arguments a frame cannot carry (a number past a float's range, nesting past the
frame's depth), carries no ``tool_call`` and its raw text. Streamed tokens are always the raw output, the call's
markup included.

Embeddings: an EMBED_REQUEST is :meth:`appliance.daemon.core.Daemon.embed` of its texts (the model's
``models[].embeddings`` must be true), answered by one EMBEDDINGS with a unit vector per input, or by ERROR
``FRAME_TOO_LARGE`` when the answer would not fit ``max_frame_bytes`` (fewer inputs fit). It counts as a task in
flight (``max_tasks_per_connection``); it cannot be cancelled half way (CANCEL is ignored for it).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance import __version__
from appliance.daemon.core import Daemon
from appliance.daemon.model import Agent, DecodeResult, FileIdentity, file_identity
from appliance.engine import toolcalls
from appliance.engine.chat import ChatTemplate, Message, read_chat_template, render_prompt
from appliance.engine.interface import Grammar, PromptText, Sampling, Token
from appliance.errors import ApplianceError
from appliance.protocol import messages as m
from appliance.protocol.connection import CLOSED, NEED_DATA, SERVER, Connection, Event
from appliance.protocol.frames import (
    HEADER,
    MAGIC,
    SUPPORTED_VERSIONS,
    VERSION,
    Frame,
    LocalProtocolError,
    RemoteProtocolError,
)
from appliance.server.heartbeat import beats_due
from appliance.server.outcome import embed, error_of, generate
from appliance.server.peer import ReadClock, flush_within, peer_gone, read_within, socket_settings, unread_bytes
from appliance.server.pump import TokenPump

if TYPE_CHECKING:
    import numpy as np

log = logging.getLogger(__name__)

READ_BYTES = 1 << 16
OFF_LOOP_FRAME_BYTES = 256 * 1024
"""Frames longer than this are decoded (base64, JSON) on a worker thread."""
UNLIKELY_LOGPROB = -9999.0
"""A STREAM_TOKEN's ``logprob`` for a token of probability 0 (the frame holds finite numbers only)."""
SAMPLING_FIELDS = ("seed", "top_k", "min_p", "repeat_penalty", "frequency_penalty", "presence_penalty")
"""INFER_REQUEST fields that are :class:`~appliance.engine.interface.Sampling` settings of the same name (None: the
engine's default)."""


@dataclass(eq=False)
class SessionTools:
    """The tools a session was started with, and the grammars made of them so far (by call format and choice: a
    grammar of many big schemas takes seconds to build, once)."""

    tools: tuple[toolcalls.Tool, ...]
    grammars: dict[tuple[toolcalls.Format, str], Grammar | None] = field(default_factory=dict)

    def grammar(self, fmt: toolcalls.Format, choice: toolcalls.Choice) -> Grammar | None:
        """``fmt``'s grammar of one call for ``choice``."""
        key = (fmt, choice if isinstance(choice, str) else f"function:{choice.name}")
        if key not in self.grammars:
            self.grammars[key] = toolcalls.grammar(fmt, self.tools, choice, False)
        return self.grammars[key]


NO_TOOLS = SessionTools(())
SESSION_TOOLS: weakref.WeakKeyDictionary[Agent, SessionTools] = weakref.WeakKeyDictionary()
"""The tools of each session a TASK_START started with some, keyed by its agent (not its name: an agent registered
again under the name starts without them); an INFER_REQUEST of that session on any connection uses them."""


def error_frame(error: ApplianceError, task_id: str | None) -> bytes:
    """An ERROR frame outside any session (the listener refusing a connection)."""
    return m.encode_message(m.ErrorMessage.of(error, task_id))


@dataclass(eq=False)
class Task:
    """One INFER_REQUEST in flight: its request, the event that stops its generation, the job running it, and when
    the last message for it was sent (its start, at first: the heartbeats count from there)."""

    request: m.InferRequest | m.EmbedRequest
    last_sent: float
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
    cancel event, which stops its generation at the next token. An INFER_REQUEST in flight gets a HEARTBEAT when
    nothing was sent for it for ``heartbeat_interval_s``, from one timer for the whole connection
    (:mod:`appliance.server.heartbeat`), armed while requests are in flight: a short request arms none.

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
        self.loop = asyncio.get_running_loop()
        self._beats: asyncio.TimerHandle | None = None  # the connection's heartbeat timer, while armed

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
            if self._beats is not None:
                self._beats.cancel()
                self._beats = None

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
        """Wait until the transport took what we wrote; False (connection aborted) if the client stopped reading.
        When the socket took everything already (a short reply) there is nothing to wait for: no wait is made."""
        transport = self.writer.transport
        if not transport.get_write_buffer_size() and not transport.is_closing():
            return True
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
        elif isinstance(message, m.InferRequest | m.EmbedRequest):
            limit = self.daemon.config.max_tasks_per_connection
            if len(self.tasks) >= limit:
                self.send(m.ErrorMessage.of(ApplianceError(
                    "TOO_MANY_TASKS", f"at most {limit} tasks in flight on one connection",
                    {"max_tasks_per_connection": limit}), message.task_id))
                return
            task = Task(message, self.loop.time())
            self.tasks[message.task_id] = task
            self.clock.busy(True)
            if self._beats is None and isinstance(message, m.InferRequest):
                self._beats = self.loop.call_at(task.last_sent + self._heartbeat_interval_s(), self._beat)
            task.job = asyncio.create_task(self.infer(task) if isinstance(message, m.InferRequest) else
                                           self.embed(message))
        elif isinstance(message, m.Cancel):
            task = self.tasks.get(message.task_id)  # the connection drops late CANCELs: this is a task in flight
            if task is not None:
                task.cancel.set()

    async def start(self, message: m.TaskStart) -> None:
        try:  # each tool's schema is checked and converted: off the loop (a big list takes seconds)
            tools = await asyncio.to_thread(toolcalls.parse_tools, message.tools) if message.tools is not None else ()
            agent = await self.daemon.register(message.session_id, message.model, owner=self.writer)
        except ApplianceError as exc:
            self.send(m.ErrorMessage.of(exc, message.task_id))
            return
        if tools:
            SESSION_TOOLS[agent] = SessionTools(tools)
        self.send(m.TaskStart(message.task_id, message.session_id, message.model, message.tools, "started"))

    # -- one INFER_REQUEST ------------------------------------------------------------------------------------------

    async def embed(self, request: m.EmbedRequest) -> None:
        task_id = request.task_id
        try:
            try:
                result = await embed(self.daemon, surface="magn", model=request.model, inputs=request.input,
                                     dimensions=request.dimensions)
                answer: m.Message = await asyncio.to_thread(embeddings_answer, request, result.vectors,
                                                            result.prompt_tokens, self.daemon.config.max_frame_bytes)
            except Exception as exc:
                answer = m.ErrorMessage.of(error_of(exc), task_id)
            self.send(answer)
        finally:
            self.tasks.pop(task_id, None)
            self.clock.busy(bool(self.tasks))
            with contextlib.suppress(ConnectionError):
                await self.flush()

    async def infer(self, task: Task) -> None:
        request = task.request
        assert isinstance(request, m.InferRequest)
        task_id = request.task_id
        pump = None  # a request that streams nothing needs none (its heartbeats are the session's)
        if request.stream:
            pump = TokenPump(self.loop, functools.partial(self._deliver, task_id), cancel=task.cancel,
                             backlog=functools.partial(unread_bytes, self.writer),
                             stall_timeout_s=self._stall_timeout_s)
        replied = False

        def reply(result: DecodeResult) -> None:
            """The TASK_COMPLETE, written as soon as the daemon has the result (before its bookkeeping); a
            generation that stopped as cancelled, or a completion that cannot be made, is left to the error path
            below, which makes the same error again and sends it."""
            nonlocal replied
            if result.generation.stop_reason == "cancelled" or (pump is not None and pump.stalled):
                return
            try:
                end = completion(task_id, result, plan.fmt)
            except Exception:
                return
            if pump is not None:
                pump.finish()  # every token before the end: nothing can follow it
            self.send(end)
            replied = True
            del self.tasks[task_id]  # answered: its slot and its task_id are free for the client's next request
            self.clock.busy(bool(self.tasks))

        try:
            try:
                plan = await self.plan(request)
                with pump or contextlib.nullcontext():  # on exit every token is delivered: nothing can follow the end
                    result = await generate(self.daemon, surface="magn", prompt=plan.prompt,
                                            max_tokens=request.max_tokens, sampling=sampling_of(request, plan.grammar),
                                            session_id=request.session_id, model=request.model,
                                            on_token=None if pump is None else pump.on_token, cancel=task.cancel,
                                            queue=("connection", id(self)), on_result=reply)
                end: m.Message | None = None if replied else completion(task_id, result, plan.fmt)
            except Exception as exc:
                error = self.stall_error(exc) if pump is not None and pump.stalled else error_of(exc)
                end = None if replied else m.ErrorMessage.of(error, task_id)
                if replied:  # nothing may follow its TASK_COMPLETE: what failed was bookkeeping after it
                    log.warning("task %s failed after its TASK_COMPLETE was sent: %s %s", task_id, error.code,
                                error.message)
            if end is not None:
                self.send(end)
        finally:
            if self.tasks.get(task_id) is task:  # once answered, its task_id may already be a new task's
                del self.tasks[task_id]
            self.clock.busy(bool(self.tasks))
            with contextlib.suppress(ConnectionError):
                await self.flush()

    async def plan(self, request: m.InferRequest) -> ChatPlan:
        """How ``request`` runs: a ``prompt`` as it is; ``messages`` rendered with its model's template and its
        session's tools (the template is code: it runs off the loop)."""
        if request.prompt is not None:
            return ChatPlan(request.prompt)
        session = NO_TOOLS
        if request.session_id is not None:
            agent = self.daemon.agent(request.session_id)
            path = agent.model.path
            session = SESSION_TOOLS.get(agent, NO_TOOLS)
        else:
            path = self.daemon.resolve(request.model or "").path
        return await asyncio.to_thread(plan_chat, path, request, session)

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
        messages = [m.StreamToken(task_id, token.text, token.id, token.timestamp, logprob_of(token))
                    for token in tokens]
        task = self.tasks.get(task_id)
        if task is not None:
            task.last_sent = self.loop.time()
        if self._parsing:
            self._held.extend(messages)
            return True
        frames = [self.encode(message) for message in messages]
        self.writer.write(b"".join(frames))
        return True

    def _beat(self) -> None:
        """The heartbeat timer fired: a HEARTBEAT for each INFER_REQUEST that had nothing sent for the interval,
        then the timer is armed for the next one due (not at all once no INFER_REQUEST is in flight)."""
        self._beats = None
        last_sent = {task_id: task.last_sent for task_id, task in self.tasks.items()
                     if isinstance(task.request, m.InferRequest)}
        now = self.loop.time()
        plan = beats_due(last_sent, now, self._heartbeat_interval_s())
        for task_id in plan.now:
            self.tasks[task_id].last_sent = now
            self.send(m.Heartbeat(task_id, time.time()))
        if plan.next_at is not None:
            self._beats = self.loop.call_at(plan.next_at, self._beat)

    def _heartbeat_interval_s(self) -> float:
        return self.daemon.config.heartbeat_interval_s


def logprob_of(token: Token) -> float | None:
    """A STREAM_TOKEN's ``logprob``: the token's log-probability when the request asked for them."""
    if token.logprobs is None:
        return None
    return min(0.0, max(UNLIKELY_LOGPROB, token.logprobs.token.logprob))


# -- chat: the prompt, the sampling and the tool call (pure but for the template file's read) --------------------------


@dataclass(frozen=True)
class ChatPlan:
    """How one INFER_REQUEST runs: its prompt, and with tools in play their call format (its output is parsed for
    a call) and grammar."""

    prompt: PromptText
    fmt: toolcalls.Format | None = None
    grammar: Grammar | None = None


@functools.lru_cache(maxsize=32)
def _template(path: str, identity: FileIdentity) -> ChatTemplate:
    return read_chat_template(path)


def model_template(path: Path) -> ChatTemplate:
    """The chat template of the model file at ``path`` (read once per version of the file). Blocking."""
    return _template(str(path), file_identity(path))


def history_message(turn: m.ChatMessage) -> Message:
    """A MAGN chat message as :func:`~appliance.engine.chat.render_prompt` takes it (a call's arguments as JSON
    text; a call without an ``id`` has an empty one)."""
    calls = tuple(toolcalls.ToolCall(call.id or "", call.name, json.dumps(call.arguments, ensure_ascii=False))
                  for call in turn.tool_calls or ())
    return Message(turn.role, turn.content, calls, turn.tool_call_id)


def plan_chat(path: Path, request: m.InferRequest, session: SessionTools) -> ChatPlan:
    """The plan of a chat request on the model file at ``path`` with its ``session``'s tools: ``tool_choice``
    checked against them (``BAD_REQUEST``), the messages rendered (the session's whole history when it has one), and
    with tools in play the format's grammar for one call. Blocking (the template is code)."""
    tools = session.tools
    choice = toolcalls.parse_choice(request.tool_choice, tools)
    template = model_template(path)
    turns = [history_message(turn) for turn in request.messages or ()]
    prompt = render_prompt(template, turns, tools, choice=choice, history=request.session_id is not None)
    if not tools or choice == "none":
        return ChatPlan(prompt)
    fmt = toolcalls.detect(template.source)
    return ChatPlan(prompt, fmt, session.grammar(fmt, choice))


def sampling_of(request: m.InferRequest, grammar: Grammar | None) -> Sampling:
    """The engine's sampling settings for ``request`` (a setting it leaves null: the engine's default)."""
    settings: dict[str, Any] = {"temperature": request.temperature, "top_p": request.top_p, "stop": request.stop,
                                "grammar": grammar, "logprobs": 0 if request.logprobs else None}
    for name in SAMPLING_FIELDS:
        value = getattr(request, name)
        if value is not None:
            settings[name] = value
    return Sampling(**settings)


def the_call(calls: list[toolcalls.ToolCall]) -> m.ToolCall | None:
    """The answer's call as TASK_COMPLETE carries it: one call whose arguments are a whole JSON object that a frame
    can carry (None when the answer made none, its call was cut short, or a frame cannot hold its arguments)."""
    if len(calls) != 1:
        return None
    call = calls[0]
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        return None
    if not isinstance(arguments, dict):
        return None
    try:
        return m.ToolCall(call.name, arguments, call.id)
    except LocalProtocolError:
        return None


STOP_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


def embeddings_answer(request: m.EmbedRequest, vectors: Sequence[np.ndarray], prompt_tokens: int,
                      max_frame_bytes: int) -> m.Embeddings:
    """The EMBEDDINGS of a request's vectors (float32 values as the HTTP route's ``float`` encoding gives them), or
    ``FRAME_TOO_LARGE`` when its frame would be over ``max_frame_bytes``. Blocking (off the loop: big lists)."""
    import numpy as np  # lazy: a serving process holds numpy only once it computes embeddings

    data = tuple(tuple(float(x) for x in np.asarray(vector, dtype="<f4")) for vector in vectors)
    answer = m.Embeddings(request.task_id, request.model, data, m.EmbedUsage(prompt_tokens))
    length = len(m.encode_message(answer)) - HEADER.size
    if length > max_frame_bytes:
        per_input = length // len(data)
        raise ApplianceError("FRAME_TOO_LARGE", f"the EMBEDDINGS of {len(data)} inputs would be a {length}-byte "
                                                f"frame, over max_frame_bytes {max_frame_bytes}: send at most "
                                                f"{max(1, max_frame_bytes // per_input)} inputs a request",
                             {"length": length, "max_frame_bytes": max_frame_bytes, "inputs": len(data)})
    return answer


def completion(task_id: str, result: DecodeResult, fmt: toolcalls.Format | None = None) -> m.TaskComplete:
    """The TASK_COMPLETE of a finished generation (SPEC E6): its times in ``timings`` (``ttft_ms`` left out when
    no token was generated), its peak memory, plan and threads in ``stats``. With a tool call format ``fmt`` the
    output is parsed: a call in an answer that ended at its end of turn (the grammar's end) is ``tool_call`` (stop
    reason ``tool_call``) and ``text`` the content around it; an answer without a call has its content as ``text``;
    one that a length or stop string cut inside its call its raw text."""
    gen = result.generation
    text = gen.text
    stop_reason = STOP_REASONS[gen.stop_reason]
    tool_call = None
    if fmt is not None:
        content, calls = toolcalls.parse(fmt, gen.text)
        tool_call = the_call(calls) if gen.stop_reason == "eos" else None
        if tool_call is not None:
            stop_reason = "tool_call"
        if tool_call is not None or not calls:
            text = content
    timings = {"elapsed_ms": gen.elapsed_s * 1000}
    if gen.ttft_s is not None:
        timings["ttft_ms"] = gen.ttft_s * 1000
    stats: dict[str, object] = {"model": result.model, "kv_swap_evicted": result.evicted,
                                "kv_swap_restored": result.restored, "kv_restored_from": result.restored_from,
                                "peak_memory_bytes": result.peak_memory_bytes,
                                "plan": result.plan, "threads": result.threads}
    if gen.prompt_evaluated is not None:  # tokens evaluated before the first new one (shared prefixes skip some)
        stats["prompt_evaluated"] = gen.prompt_evaluated
    if result.notice is not None:  # once: its model was reloaded with another vocabulary
        stats["notice"] = result.notice
    if fmt is not None:
        stats["tool_format"] = fmt.name
    return m.TaskComplete(task_id, text, m.Usage(gen.prompt_tokens, gen.generated_tokens), stop_reason, timings,
                          tool_call, stats=stats)


async def serve_magn(daemon: Daemon, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     initial: bytes) -> None:
    await MagnSession(daemon, writer).serve(reader, initial)
