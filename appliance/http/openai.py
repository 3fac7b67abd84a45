"""The OpenAI-compatible API (SPEC W2): ``GET /v1/models``, ``POST /v1/chat/completions``, ``POST /v1/completions``,
plain or streamed as server-sent events. Requests and responses are checked and shaped by the pure
:mod:`appliance.http.openai_schema`; this module does the IO (docs/openai-api.md says what a client sees).

* **One request path.** Every generation goes through :func:`appliance.server.outcome.generate` (surface
  ``openai``): the same ledger, engine, agents and request log as the socket protocols, and the one error mapping
  of :mod:`appliance.http.app` for every failure (before a stream starts: its HTTP status; after: an
  ``data: {"error": ...}`` event).
* **Stateless or an agent.** Without ``user`` (or an ``X-Agent-Id`` header, which wins) a request runs on a fresh
  context in its connection's engine queue. With one, it runs in that agent's conversation, registered on first use
  (owner none: it outlives the connection; ``agent_idle_ttl_s`` expires it; past ``max_agents`` a new one is 429
  ``TOO_MANY_AGENTS``; once idle past its model's ``idle_ttl_s`` it goes dormant and lets the model unload:
  :mod:`appliance.daemon.dormancy`). ``user`` follows the agents' one rule (protocol.identifiers) and names an end
  user: its agent is the user's on the request's model (:func:`~appliance.protocol.identifiers.user_agent_id`,
  ``<user>@<model>``); ``X-Agent-Id`` names the agent itself. The client re-sends the
  whole history every turn, so an agent's prompt is a :class:`~appliance.engine.interface.Prompt` with ``history``:
  the engine keeps the longest common token prefix of what the conversation holds and the new prompt, and
  evaluates the rest. ``usage.prompt_tokens`` is OpenAI's total (every token of the prompt the model saw);
  ``usage.prompt_tokens_details.cached_tokens`` is the part not evaluated again (kept, or shared: SPEC L10).
* **Prompts.** A chat's messages (with its tools, the history's calls and the tools' results) are rendered by the
  model's chat template into a ``Prompt`` (:func:`appliance.engine.chat.render_prompt`) whose template text keeps
  its control tokens and whose message content never becomes one. A completion's ``prompt`` is template text as a
  whole: control-token texts in it become control tokens, as llama-server does.
* **Tool calls and structured output.** The grammar of the request's tools (:func:`appliance.engine.toolcalls.
  grammar`, for the format the template's model writes) or of its ``response_format`` (:mod:`appliance.engine.
  structured`) constrains the sampling; the output is parsed into ``message.tool_calls`` (streamed: as
  ``delta.tool_calls`` by :class:`~appliance.engine.toolcalls.StreamParser`).
* **Cancel.** A client that disconnects, mid-stream or while it waits for a plain response, sets the generation's
  cancel event: the engine stops at its next token.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import secrets
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Hashable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from appliance.daemon.core import Daemon
from appliance.daemon.model import Agent, DecodeResult, FileIdentity, file_identity
from appliance.daemon.requestlog import Surface
from appliance.engine import reasoning, toolcalls
from appliance.engine.chat import ChatTemplate, read_chat_template, render_prompt
from appliance.engine.interface import Generation, Grammar, Prompt, PromptText, Token, TokenLogprobs
from appliance.engine.reply import ReplyEvent, ReplyStream
from appliance.errors import ApplianceError
from appliance.http import chunkwrite, sse
from appliance.http import openai_schema as schema
from appliance.http.affinity import note_run
from appliance.http.chunkwrite import ChunkWriter
from appliance.http.errors import error_body
from appliance.http.jsonreply import JSONReply
from appliance.protocol.identifiers import user_agent_id
from appliance.server.outcome import error_of, generate
from appliance.server.pump import TokenPump

log = logging.getLogger(__name__)

AGENT_HEADER = "x-agent-id"
PING = b": ping\n\n"
"""An SSE comment sent while no token came for ``heartbeat_interval_s`` (clients ignore it; proxies keep the
connection open)."""


# -- reading a request ---------------------------------------------------------------------------------------------


def body_too_large() -> ApplianceError:
    limit = schema.MAX_BODY_BYTES
    return schema.bad(None, f"the request body is over {limit} bytes", max_body_bytes=limit)


async def read_body(request: Request) -> bytes:
    """The request body, read up to :data:`~appliance.http.openai_schema.MAX_BODY_BYTES` (refused beyond)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > schema.MAX_BODY_BYTES:
        raise body_too_large()
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > schema.MAX_BODY_BYTES:
            raise body_too_large()
        chunks.append(chunk)
    return b"".join(chunks)


def daemon_of(request: Request) -> Daemon:
    daemon = request.app.state.appliance.daemon
    if daemon is None:
        raise ApplianceError("SHUTTING_DOWN", "the daemon is not running")
    return daemon


@functools.lru_cache(maxsize=32)
def _template(path: str, identity: FileIdentity) -> ChatTemplate:
    return read_chat_template(path)


def model_template(path: Path) -> ChatTemplate:
    """The chat template of the model file at ``path`` (read once per version of the file). Blocking."""
    return _template(str(path), file_identity(path))


@dataclass(frozen=True)
class ChatPlan:
    """What a chat request runs: its prompt, the call format its output is parsed with (None: the output is all
    content) and the grammar of its tools (None: none, or ``tool_choice: none``)."""

    prompt: Prompt
    calls: toolcalls.Format | None
    grammar: Grammar | None
    reasoning_markers: reasoning.Markers | None = None  # the template writes <think>: its reasoning is split out
    thinking: bool = False  # the prompt ends inside the reasoning (the reply has only its closing marker)

    def splitter(self) -> reasoning.StreamSplitter | None:
        """A fresh splitter of this reply's reasoning (None: it is all answer)."""
        if self.reasoning_markers is None:
            return None
        return reasoning.StreamSplitter(self.reasoning_markers, inside=self.thinking)


def chat_plan(path: Path, request: schema.ChatRequest, reasoning_mode: str = "split") -> ChatPlan:
    """``request`` rendered with the chat template of the model file at ``path``, with the grammar of its tools in
    the format that template's model writes calls in, and the template's reasoning markers unless
    ``reasoning_mode`` (``models[].reasoning``) is ``inline``. Blocking (off the loop: a template is code and may be
    slow, and a grammar is built from every tool's schema)."""
    template = model_template(path)
    fmt = toolcalls.detect(template.source)
    prompt = render_prompt(template, request.messages, request.tools, choice=request.tool_choice)
    grammar = toolcalls.grammar(fmt, request.tools, request.tool_choice, request.parallel_tool_calls)
    markers = reasoning.detect(template.source) if reasoning_mode == "split" else None
    thinking = markers is not None and reasoning.starts_inside(prompt.text, markers)
    return ChatPlan(prompt, fmt if request.calls_tools else None, grammar, markers, thinking)


def completion_prompt(text: str) -> Prompt:
    """A completion's ``prompt``: template text as a whole (control-token texts become control tokens)."""
    return Prompt(((text, True),))


# -- agents --------------------------------------------------------------------------------------------------------


class Registrations:
    """A lock per agent id while an HTTP request registers it, so that two first requests of one agent register it
    once (the second waits, then finds it)."""

    def __init__(self) -> None:
        self.locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    def lock(self, agent_id: str) -> asyncio.Lock:
        lock = self.locks.get(agent_id)
        if lock is None:
            lock = self.locks[agent_id] = asyncio.Lock()
        return lock


def registrations(request: Request) -> Registrations:
    state = request.app.state
    found = getattr(state, "openai_registrations", None)
    if found is None:
        found = state.openai_registrations = Registrations()
    return found


async def agent_for(daemon: Daemon, agent_id: str, model: str, param: str) -> Agent:
    """The agent ``agent_id``, registered on ``model`` at its first use (owner none: it outlives the connection; it
    lets its model go once idle: :mod:`appliance.daemon.dormancy`)."""
    agent = daemon.agents.get(agent_id)
    if agent is None:
        agent = await daemon.register(agent_id, model, releases_model=True)
    if agent.owner is not None:
        raise schema.bad(param, f"agent {agent_id!r} belongs to a socket connection's session", agent=agent_id)
    if agent.model.key != model and daemon.resolve(model) is not agent.model:
        raise schema.bad("model", f"agent {agent_id!r} is on model {agent.model.key!r}, not {model!r}",
                         agent=agent_id, agent_model=agent.model.key)
    return agent


# -- one generation ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Done:
    """A generation's end as the response needs it."""

    result: DecodeResult

    @property
    def generation(self) -> Generation:
        return self.result.generation

    def finish(self, called: bool = False) -> str:
        return schema.finish_reason(self.generation.stop_reason, called)

    def usage(self) -> dict[str, Any]:
        """OpenAI's ``usage`` and the appliance's extensions (docs/openai-api.md): ``prompt_evaluated``, the
        generation's times (``ttft_ms`` null when no token was generated), its peak memory, plan and threads.
        ``cached_tokens``: the prompt's tokens not evaluated (kept by the conversation, or shared, SPEC L10)."""
        result = self.result
        generation = result.generation
        total = generation.prompt_tokens
        cached = 0
        if generation.prompt_evaluated is not None:
            cached = max(0, total - generation.prompt_evaluated)
        body = schema.usage(total, generation.generated_tokens, cached)
        if generation.prompt_evaluated is not None:
            body["prompt_evaluated"] = generation.prompt_evaluated
        body["ttft_ms"] = round(generation.ttft_s * 1000, 3) if generation.ttft_s is not None else None
        body["elapsed_ms"] = round(generation.elapsed_s * 1000, 3)
        body["peak_memory_bytes"] = result.peak_memory_bytes
        body["plan"] = result.plan
        body["threads"] = result.threads
        body["kv_restored_from"] = result.restored_from
        return body


END = object()
"""The queue item after a generation's last token batch."""


class Run:
    """One generation for one HTTP request: its task, its cancel event and, when streamed, the queue of token
    batches its :class:`~appliance.server.pump.TokenPump` fills on the loop. An agent's prompt is sent as its
    conversation's whole text (``history``). ``surface``: the API it is recorded under (request log, metrics)."""

    def __init__(self, request: Request, daemon: Daemon, options: schema.Options, prompt: Prompt, *,
                 grammar: Grammar | None = None, surface: Surface = "openai") -> None:
        self.daemon = daemon
        self.surface: Surface = surface
        self.options = options
        self.agent_id = self.agent_name(request)
        self.prompt: PromptText = dataclasses.replace(prompt, history=self.agent_id is not None)
        self.grammar = grammar
        self.grammar_param = "response_format" if options.response_grammar is not None else "tools"
        self.cancel = threading.Event()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.direct: Callable[[list[Token]], bool] | None = None  # set by a stream waiting for tokens (TokenWrites)
        self.param = "X-Agent-Id" if AGENT_HEADER in request.headers else "user"
        self.registrations = registrations(request)
        client = request.scope.get("client") or ("?", 0)
        self.connection: Hashable = ("http", *client)
        self.pump: TokenPump | None = None
        if options.stream:
            self.pump = TokenPump(asyncio.get_running_loop(), self._sink, cancel=self.cancel, heartbeat=self._ping,
                                  heartbeat_interval_s=self._heartbeat_interval_s)
        self.task: asyncio.Task[Done] = asyncio.create_task(self._run())
        self.task.add_done_callback(self._ended)
        note_run(request, self)  # its agent goes into the reply's headers (appliance.http.affinity)

    def agent_name(self, request: Request) -> str | None:
        """The agent this request runs in: its ``X-Agent-Id`` header, else its ``user``, else none (stateless)."""
        return schema.agent_name(self.options.user, request.headers.get(AGENT_HEADER))

    def _sink(self, tokens: list[Token]) -> bool:
        direct = self.direct
        if direct is None or not direct(tokens):
            self.queue.put_nowait(tokens)
        return True

    def _ping(self) -> None:
        self.queue.put_nowait(PING)

    def _heartbeat_interval_s(self) -> float:
        return self.daemon.config.heartbeat_interval_s

    def _ended(self, task: asyncio.Task[Done]) -> None:
        if not task.cancelled():
            task.exception()  # retrieved here: a stream whose client left never reads it
        self.queue.put_nowait(END)

    def max_tokens(self) -> int:
        requested = self.options.max_tokens
        return self.daemon.resolve(self.options.model).spec.n_ctx if requested is None else requested

    async def _run(self) -> Done:
        if self.agent_id is None:
            return Done(await self._generate(model=self.options.model, queue=self.connection))
        with self.daemon.accepting():  # its agent's registration and its decode are one request (a stop's grace)
            if self.param == "user":  # an end user, not a conversation: the user's agent on this model
                self.agent_id = user_agent_id(self.agent_id, self.daemon.resolve(self.options.model).key)
            async with self.registrations.lock(self.agent_id):
                agent = await agent_for(self.daemon, self.agent_id, self.options.model, self.param)
            return Done(await self._generate(session_id=agent.id))

    async def _generate(self, *, model: str | None = None, session_id: str | None = None,
                        queue: Hashable | None = None) -> DecodeResult:
        sampling = self.options.sampling(secrets.randbits(32), self.grammar)
        on_token = None if self.pump is None else self.pump.on_token
        try:
            with self.pump if self.pump is not None else contextlib.nullcontext():
                return await generate(self.daemon, surface=self.surface, prompt=self.prompt,
                                      max_tokens=self.max_tokens(), sampling=sampling, session_id=session_id,
                                      model=model, on_token=on_token, cancel=self.cancel, queue=queue)
        except ApplianceError as exc:
            raise grammar_error(exc, self.grammar_param) from None

    async def watch(self, request: Request, awaitable: asyncio.Future[Any]) -> Any:
        """Await ``awaitable`` while watching the connection: a client that disconnects cancels the generation."""
        watcher = asyncio.create_task(disconnected(request, self.cancel))
        try:
            return await awaitable
        finally:
            watcher.cancel()


def grammar_error(exc: ApplianceError, param: str) -> ApplianceError:
    """The engine's refusal of a request's grammar (``param: grammar``) as the refusal of the field it was made of
    (``tools``, ``response_format``); any other error as it is."""
    if exc.code != "BAD_REQUEST" or exc.details.get("param") != "grammar":
        return exc
    return ApplianceError(exc.code, f"{param}: {exc.message}", {**exc.details, "param": param})


async def disconnected(request: Request, cancel: threading.Event) -> None:
    """Set ``cancel`` when the client disconnects (the request body has been read: the next ASGI message is the
    disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            cancel.set()
            return


def outcome(task: asyncio.Task[Done]) -> Done:
    """A finished run's result, or its P4 error raised."""
    try:
        return task.result()
    except ApplianceError:
        raise
    except Exception as exc:
        raise error_of(exc) from None


# -- answers -------------------------------------------------------------------------------------------------------


def chat_answer(done: Done, calls: toolcalls.Format | None, logprobs: bool,
                plan: ChatPlan | None = None) -> tuple[dict[str, Any], str, dict[str, Any] | None]:
    """A finished chat generation's ``message``, ``finish_reason`` and ``logprobs``: its reasoning split out (as
    ``reasoning_content``) when ``plan`` says the template writes some, the rest parsed for tool calls in the format
    ``calls`` (None: it is all content)."""
    generation = done.generation
    content: str | None = generation.text
    thought = None
    if plan is not None and plan.reasoning_markers is not None:
        parts = reasoning.split(generation.text, plan.reasoning_markers, inside=plan.thinking)
        content, thought = parts.content, parts.reasoning
    found: list[toolcalls.ToolCall] = []
    if calls is not None:
        content, found = toolcalls.parse(calls, content or "")
        if found and not content:
            content = None
    entries = schema.chat_logprobs_of(generation.logprobs) if logprobs else None
    message = schema.assistant_message(content, found)
    if thought is not None:
        message["reasoning_content"] = thought
    return message, done.finish(bool(found)), entries


# -- streaming -----------------------------------------------------------------------------------------------------


class Shape:
    """How one endpoint's stream looks: its opening event, the chunks of a batch of tokens, its last chunks."""

    obj = ""

    def __init__(self, model: str, include_usage: bool, prefix: str, logprobs: bool) -> None:
        self.ident = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage
        self.logprobs = logprobs
        self.pending: list[TokenLogprobs] = []  # the log-probabilities of tokens no chunk carried yet

    def opening(self) -> list[bytes]:
        return []

    def tokens(self, batch: Sequence[Token]) -> list[bytes]:
        raise NotImplementedError

    def finish(self, done: Done) -> list[bytes]:
        raise NotImplementedError

    def usage(self, done: Done) -> bytes:
        return schema.event(schema.usage_chunk(self.ident, self.created, self.model, done.usage(), self.obj))

    def hold(self, batch: Sequence[Token]) -> None:
        self.pending.extend(token.logprobs for token in batch if token.logprobs is not None)

    def take(self) -> list[TokenLogprobs]:
        taken, self.pending = self.pending, []
        return taken


def chat_deltas(events: Sequence[toolcalls.Event]) -> list[dict[str, Any]]:
    """The ``delta`` s of a parser's events: content text, a call's start (index, id, type, name; its arguments
    empty), its arguments' pieces; content in a row is one delta, and so are one call's pieces in a row."""
    deltas: list[dict[str, Any]] = []
    for event in events:
        last = deltas[-1] if deltas else None
        if isinstance(event, toolcalls.Content):
            if last is not None and "content" in last:
                last["content"] += event.text
            else:
                deltas.append({"content": event.text})
        elif isinstance(event, toolcalls.CallStart):
            deltas.append({"tool_calls": [schema.call_start(event.index, event.id, event.name)]})
        elif last is not None and "tool_calls" in last and "id" not in last["tool_calls"][0] and (
                last["tool_calls"][0]["index"] == event.index):
            last["tool_calls"][0]["function"]["arguments"] += event.text
        else:
            deltas.append({"tool_calls": [schema.call_arguments(event.index, event.text)]})
    return deltas


class ChatShape(Shape):
    """A chat stream; with a call format, its text goes through that format's streaming parser, so calls are sent
    as ``delta.tool_calls`` (and their markers never as content)."""

    obj = "chat.completion.chunk"

    def __init__(self, model: str, include_usage: bool, logprobs: bool, calls: toolcalls.Format | None,
                 thoughts: reasoning.StreamSplitter | None = None) -> None:
        super().__init__(model, include_usage, "chatcmpl", logprobs)
        parser = None if calls is None else toolcalls.StreamParser(calls)
        self.reply = ReplyStream(thoughts, parser)  # the reasoning split out first (``delta.reasoning_content``)
        self.called = False

    def chunk(self, delta: dict[str, Any], finish: str | None) -> bytes:
        logprobs = schema.chat_logprobs_of(self.take()) if self.logprobs else None
        return schema.event(schema.chat_chunk(self.ident, self.created, self.model, delta, finish,
                                              self.include_usage, logprobs))

    def opening(self) -> list[bytes]:
        return [self.chunk({"role": "assistant", "content": ""}, None)]

    def chunks(self, events: Sequence[ReplyEvent]) -> list[bytes]:
        """The chunks of a reply's events: reasoning as ``delta.reasoning_content``, content as ``delta.content``,
        calls as ``delta.tool_calls``; consecutive answer events share a delta list, in order."""
        out: list[bytes] = []
        answer: list[toolcalls.Event] = []
        for event in events:
            if isinstance(event, reasoning.Reasoning):
                out.extend(self.deltas(answer))
                answer = []
                out.append(self.chunk({"reasoning_content": event.text}, None))
            else:
                answer.append(event)
        out.extend(self.deltas(answer))
        return out

    def deltas(self, events: Sequence[toolcalls.Event]) -> list[bytes]:
        self.called = self.called or any(isinstance(event, toolcalls.CallStart) for event in events)
        return [self.chunk(delta, None) for delta in chat_deltas(events)]

    def tokens(self, batch: Sequence[Token]) -> list[bytes]:
        self.hold(batch)
        return self.chunks(self.reply.feed("".join(token.text for token in batch)))

    def finish(self, done: Done) -> list[bytes]:
        return [*self.chunks(self.reply.finish()), self.chunk({}, done.finish(self.called))]


class CompletionShape(Shape):
    obj = "text_completion"

    def __init__(self, model: str, include_usage: bool, logprobs: bool) -> None:
        super().__init__(model, include_usage, "cmpl", logprobs)
        self.offset = 0  # where the next token's text starts in the completion (its log-probabilities' offsets)

    def chunk(self, text: str, finish: str | None) -> bytes:
        logprobs = None
        if self.logprobs:
            entries = self.take()
            logprobs = schema.completion_logprobs_of(entries, self.offset)
            self.offset += sum(len(schema.token_text(entry.token.piece)) for entry in entries)
        return schema.event(schema.text_completion(self.ident, self.created, self.model, text, finish, None,
                                                   with_usage=self.include_usage, logprobs=logprobs))

    def tokens(self, batch: Sequence[Token]) -> list[bytes]:
        self.hold(batch)
        text = "".join(token.text for token in batch)
        return [self.chunk(text, None)] if text else []

    def finish(self, done: Done) -> list[bytes]:
        return [self.chunk("", done.finish())]


async def events(run: Run, first: Any, shape: Shape, chunks: ChunkWriter | None = None) -> AsyncIterator[bytes]:
    """The SSE body, one bytes object per write: the opening chunk, the chunks of each batch of tokens, the last
    chunks, the usage chunk (``include_usage``) and ``[DONE]``; an error after the start is one
    ``data: {"error": ...}`` event. Everything queued at a wake-up is one write (:func:`sse.deliveries`): the opening
    goes with the first tokens, and the end (last chunks, usage, ``[DONE]``) with whatever came just before it. If
    the stream stops early (its client left), the generation is cancelled.

    With the request's ``chunks`` writer, tokens that come while the stream waits for them are written without
    waking this generator (:class:`~appliance.http.sse.TokenWrites`)."""

    def render(batch: Sequence[Token]) -> bytes:
        return b"".join(shape.tokens(batch))

    writes = sse.TokenWrites(run, render, chunks)
    try:
        out = shape.opening()
        async for items, last in sse.deliveries(run.queue, first, END, writes.parked):
            for item in items:
                out.extend((item,) if isinstance(item, bytes) else shape.tokens(item))  # a ping, rendered tokens
            if out and not last:
                yield b"".join(out)
                out = []
        try:
            done = outcome(run.task)
        except ApplianceError as exc:
            out.append(schema.event(error_body(exc)))
            yield b"".join(out)
            return
        out.extend(shape.finish(done))
        if shape.include_usage:
            out.append(shape.usage(done))
        out.append(schema.event("[DONE]"))
        yield b"".join(out)
    finally:
        writes.parked(False)
        if not run.task.done():
            run.cancel.set()  # the client left: the engine stops at its next token


async def first_batch(request: Request, run: Run) -> Any:
    """A streamed run's first queue item (its first tokens, or :data:`END`): a failure before the first token is
    raised, to be its own response with its status; a request cancelled meanwhile (the server stops) cancels its
    generation."""
    try:
        first = await run.watch(request, asyncio.ensure_future(run.queue.get()))
        if first is END:
            outcome(run.task)
    except BaseException:
        run.cancel.set()
        raise
    return first


async def respond(request: Request, run: Run, shape: Shape, plain: Any) -> Response:
    """Wait for the generation's first tokens (or its end), then stream; without a stream, wait for its end and
    answer ``plain(done)``. An error before the stream starts is its P4 response with its status."""
    if run.pump is None:
        await run.watch(request, run.task)
        return JSONReply(plain(outcome(run.task)))
    first = await first_batch(request, run)
    return sse.EventStream(events(run, first, shape, chunkwrite.writer_of(request.scope)), run.cancel.set)


# -- routes --------------------------------------------------------------------------------------------------------


def configured_models(request: Request) -> list[tuple[str, int, str]]:
    """(name, created, root) of each configured model and then of each of its aliases (``root``: the model's own
    name); ``created`` is its file's modification time."""
    specs = request.app.state.appliance.config.models
    models: list[tuple[str, int, str]] = []
    for spec in specs:
        created = file_identity(spec.path)[3] // 1_000_000_000
        models.append((spec.name, created, spec.name))
        models.extend((alias, created, spec.name) for alias in spec.aliases)
    return models


async def list_models(request: Request) -> JSONResponse:
    return JSONResponse(schema.model_list(configured_models(request)))


async def get_model(request: Request) -> JSONResponse:
    name = request.path_params["model"]
    models = configured_models(request)
    for entry in schema.model_list(models)["data"]:
        if entry["id"] == name:
            return JSONResponse(entry)
    raise ApplianceError("UNKNOWN_MODEL", f"no model named {name!r}",
                         {"model": name, "known": [known for known, _, _ in models]})


Checked = TypeVar("Checked")


async def checked(check: Callable[[dict[str, Any]], Checked], body: dict[str, Any]) -> Checked:
    """``check(body)``: off the event loop when it may build a grammar (:func:`schema.builds_grammar`), else on it
    (a thread hop costs more than checking a plain body)."""
    if schema.builds_grammar(body):
        return await asyncio.to_thread(check, body)
    return check(body)


async def chat_completions(request: Request) -> Response:
    body = schema.parse_body(await read_body(request))
    options = await checked(schema.chat_request, body)
    daemon = daemon_of(request)
    model = daemon.resolve(options.model)
    plan = await asyncio.to_thread(chat_plan, model.path, options, model.spec.reasoning)
    logprobs = options.logprobs is not None
    run = Run(request, daemon, options, plan.prompt, grammar=plan.grammar)
    shape = ChatShape(options.model, options.include_usage, logprobs, plan.calls, plan.splitter())

    def plain(done: Done) -> dict[str, Any]:
        message, finish, entries = chat_answer(done, plan.calls, logprobs, plan)
        return schema.chat_completion(shape.ident, shape.created, options.model, message, finish, done.usage(),
                                      entries)

    return await respond(request, run, shape, plain)


async def completions(request: Request) -> Response:
    body = schema.parse_body(await read_body(request))
    options = await checked(schema.completion_request, body)
    daemon = daemon_of(request)
    daemon.resolve(options.model)
    logprobs = options.logprobs is not None
    run = Run(request, daemon, options, completion_prompt(options.prompt))
    shape = CompletionShape(options.model, options.include_usage, logprobs)

    def plain(done: Done) -> dict[str, Any]:
        generation = done.generation
        entries = schema.completion_logprobs_of(generation.logprobs) if logprobs else None
        return schema.text_completion(shape.ident, shape.created, options.model, generation.text, done.finish(),
                                      done.usage(), logprobs=entries)

    return await respond(request, run, shape, plain)


routes: list[BaseRoute] = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
]
