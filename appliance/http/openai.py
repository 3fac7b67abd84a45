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
  ``TOO_MANY_AGENTS``). ``user`` follows the agents' one rule (protocol.identifiers). The client re-sends the
  whole history every turn; :class:`AgentTexts` keeps, per agent, the text its conversation holds (prompts and
  completions), and only the new suffix of the rendered prompt is decoded when the prompt starts with it. When it does
  not (the client edited the history, or a stop string cut the last completion short of what the conversation holds),
  the conversation is reset and the whole prompt evaluated. ``usage.prompt_tokens`` is OpenAI's total (every token of
  the prompt the model saw); ``usage.prompt_tokens_details.cached_tokens`` is the part the conversation already held,
  not evaluated again.
* **Cancel.** A client that disconnects, mid-stream or while it waits for a plain response, sets the generation's
  cancel event: the engine stops at its next token.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import secrets
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route

from appliance.daemon.core import Agent, Daemon, DecodeResult, FileIdentity, file_identity
from appliance.engine.chat import ChatTemplate, Turn, read_chat_template, render_template
from appliance.engine.interface import Token
from appliance.errors import ApplianceError
from appliance.http import openai_schema as schema
from appliance.http.errors import error_body
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


def chat_prompt(path: Path, messages: tuple[Turn, ...]) -> str:
    """``messages`` rendered with the chat template of the model file at ``path``. Blocking (off the loop: a
    template is code and may be slow)."""
    return render_template(model_template(path), messages)


# -- agents --------------------------------------------------------------------------------------------------------


@dataclass
class Held:
    """The text an agent's conversation holds (None: not known) when it had ``n_tokens`` tokens."""

    text: str | None
    n_tokens: int


class AgentTexts:
    """Per agent (by identity: a re-registered agent of the same name starts unknown): the text its conversation
    holds, and a lock that keeps one HTTP request at a time on it."""

    def __init__(self) -> None:
        self.held: weakref.WeakKeyDictionary[Agent, Held] = weakref.WeakKeyDictionary()
        self.locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    def lock(self, agent_id: str) -> asyncio.Lock:
        lock = self.locks.get(agent_id)
        if lock is None:
            lock = self.locks[agent_id] = asyncio.Lock()
        return lock

    def text(self, agent: Agent) -> str | None:
        """What ``agent``'s conversation holds: "" when it is empty, None when that is not known (another
        surface decoded on it, a reload reset it, a stop string cut its last completion)."""
        n_tokens = len(agent.conversation.tokens)
        if n_tokens == 0:
            return ""
        held = self.held.get(agent)
        if held is None or held.n_tokens != n_tokens:
            return None
        return held.text


def agent_texts(request: Request) -> AgentTexts:
    state = request.app.state
    texts = getattr(state, "openai_agents", None)
    if texts is None:
        texts = state.openai_agents = AgentTexts()
    return texts


async def agent_for(daemon: Daemon, agent_id: str, model: str, param: str) -> Agent:
    """The agent ``agent_id``, registered on ``model`` at its first use (owner none: it outlives the connection)."""
    agent = daemon.agents.get(agent_id)
    if agent is None:
        agent = await daemon.register(agent_id, model)  # our per-agent lock: nobody else registers it meanwhile
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
    cached_tokens: int

    @property
    def text(self) -> str:
        return self.result.generation.text

    @property
    def finish(self) -> str:
        return schema.finish_reason(self.result.generation.stop_reason)

    def usage(self) -> dict[str, Any]:
        """OpenAI's ``usage`` and the appliance's extensions (docs/openai-api.md): ``prompt_evaluated``, the
        generation's times (``ttft_ms`` null when no token was generated), its peak memory, plan and threads."""
        result = self.result
        generation = result.generation
        total = self.cached_tokens + generation.prompt_tokens
        cached = self.cached_tokens
        if generation.prompt_evaluated is not None:  # a shared prefix (L10) saved more than the conversation held
            cached = max(cached, total - generation.prompt_evaluated)
        body = schema.usage(total, generation.generated_tokens, cached)
        if generation.prompt_evaluated is not None:
            body["prompt_evaluated"] = generation.prompt_evaluated
        body["ttft_ms"] = round(generation.ttft_s * 1000, 3) if generation.ttft_s is not None else None
        body["elapsed_ms"] = round(generation.elapsed_s * 1000, 3)
        body["peak_memory_bytes"] = result.peak_memory_bytes
        body["plan"] = result.plan
        body["threads"] = result.threads
        return body


END = object()
"""The queue item after a generation's last token batch."""


class Run:
    """One generation for one HTTP request: its task, its cancel event and, when streamed, the queue of token
    batches its :class:`~appliance.server.pump.TokenPump` fills on the loop."""

    def __init__(self, request: Request, daemon: Daemon, options: schema.Options, prompt: str, *,
                 stream: bool) -> None:
        self.daemon = daemon
        self.options = options
        self.prompt = prompt
        self.cancel = threading.Event()
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.agent_id = schema.agent_name(options.user, request.headers.get(AGENT_HEADER))
        self.param = "X-Agent-Id" if AGENT_HEADER in request.headers else "user"
        self.texts = agent_texts(request)
        client = request.scope.get("client") or ("?", 0)
        self.connection: Hashable = ("http", *client)
        self.pump: TokenPump | None = None
        if stream:
            self.pump = TokenPump(asyncio.get_running_loop(), self._sink, cancel=self.cancel, heartbeat=self._ping,
                                  heartbeat_interval_s=self._heartbeat_interval_s)
        self.task: asyncio.Task[Done] = asyncio.create_task(self._run())
        self.task.add_done_callback(self._ended)

    def _sink(self, tokens: list[Token]) -> bool:
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
            result = await self._generate(self.prompt, model=self.options.model, queue=self.connection)
            return Done(result, 0)
        with self.daemon.accepting():  # its agent's registration and its decode are one request (a stop's grace)
            return await self._run_agent(self.agent_id)

    async def _run_agent(self, agent_id: str) -> Done:
        async with self.texts.lock(agent_id):
            agent = await agent_for(self.daemon, agent_id, self.options.model, self.param)
            suffix = schema.continuation(self.texts.text(agent), self.prompt)
            if suffix is None:  # the history changed: start the conversation over
                await self.daemon.reset_conversation(agent.id)
                suffix = self.prompt
            cached = len(agent.conversation.tokens)
            result = await self._generate(suffix, session_id=agent.id)
            generation = result.generation
            # Not known when a stop string ended the text short of the tokens the conversation keeps, or a reload
            # of its model reset the conversation while this request waited.
            known = generation.stop_reason != "stop" and result.notice is None
            text = self.prompt + generation.text if known else None
            self.texts.held[agent] = Held(text, len(agent.conversation.tokens))
            return Done(result, 0 if result.rebuilt else cached)

    async def _generate(self, prompt: str, *, model: str | None = None, session_id: str | None = None,
                        queue: Hashable | None = None) -> DecodeResult:
        sampling = self.options.sampling(secrets.randbits(32))
        on_token = None if self.pump is None else self.pump.on_token
        with self.pump if self.pump is not None else contextlib.nullcontext():
            return await generate(self.daemon, surface="openai", prompt=prompt, max_tokens=self.max_tokens(),
                                  sampling=sampling, session_id=session_id, model=model, on_token=on_token,
                                  cancel=self.cancel, queue=queue)

    async def watch(self, request: Request, awaitable: asyncio.Future[Any]) -> Any:
        """Await ``awaitable`` while watching the connection: a client that disconnects cancels the generation."""
        watcher = asyncio.create_task(disconnected(request, self.cancel))
        try:
            return await awaitable
        finally:
            watcher.cancel()


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


# -- streaming -----------------------------------------------------------------------------------------------------


class Shape:
    """How one endpoint's stream looks: its opening event, a text delta, its last chunk."""

    obj = ""

    def __init__(self, model: str, include_usage: bool, prefix: str) -> None:
        self.ident = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.include_usage = include_usage

    def opening(self) -> list[bytes]:
        return []

    def delta(self, text: str) -> bytes:
        raise NotImplementedError

    def finish(self, done: Done) -> bytes:
        raise NotImplementedError

    def usage(self, done: Done) -> bytes:
        return schema.event(schema.usage_chunk(self.ident, self.created, self.model, done.usage(), self.obj))


class ChatShape(Shape):
    obj = "chat.completion.chunk"

    def chunk(self, delta: dict[str, Any], finish: str | None) -> bytes:
        return schema.event(schema.chat_chunk(self.ident, self.created, self.model, delta, finish,
                                              self.include_usage))

    def opening(self) -> list[bytes]:
        return [self.chunk({"role": "assistant", "content": ""}, None)]

    def delta(self, text: str) -> bytes:
        return self.chunk({"content": text}, None)

    def finish(self, done: Done) -> bytes:
        return self.chunk({}, done.finish)


class CompletionShape(Shape):
    obj = "text_completion"

    def chunk(self, text: str, finish: str | None) -> bytes:
        return schema.event(schema.text_completion(self.ident, self.created, self.model, text, finish, None,
                                                   with_usage=self.include_usage))

    def delta(self, text: str) -> bytes:
        return self.chunk(text, None)

    def finish(self, done: Done) -> bytes:
        return self.chunk("", done.finish)


async def events(run: Run, first: Any, shape: Shape) -> AsyncIterator[bytes]:
    """The SSE body: the opening chunk, a chunk per batch of tokens, the last chunk, the usage chunk
    (``include_usage``) and ``[DONE]``; an error after the start is one ``data: {"error": ...}`` event. If the client
    goes away (Starlette cancels this generator), the generation is cancelled."""
    try:
        for opening in shape.opening():
            yield opening
        item = first
        while item is not END:
            if item is PING:
                yield PING
            else:
                text = "".join(token.text for token in item)
                if text:
                    yield shape.delta(text)
            item = await run.queue.get()
        try:
            done = outcome(run.task)
        except ApplianceError as exc:
            yield schema.event(error_body(exc))
            return
        yield shape.finish(done)
        if shape.include_usage:
            yield shape.usage(done)
        yield schema.event("[DONE]")
    finally:
        if not run.task.done():
            run.cancel.set()  # the client left: the engine stops at its next token


async def respond(request: Request, run: Run, shape: Shape, plain: Any) -> Response:
    """Wait for the generation's first tokens (or its end), then stream; without a stream, wait for its end and
    answer ``plain(done)``. An error before the stream starts is its P4 response with its status."""
    if run.pump is None:
        await run.watch(request, run.task)
        return JSONResponse(plain(outcome(run.task)))
    try:
        first = await run.watch(request, asyncio.ensure_future(run.queue.get()))
    except BaseException:
        run.cancel.set()  # this request is being cancelled (the server stops): so is its generation
        raise
    if first is END:
        outcome(run.task)  # raises a failure before the first token as its own response
    return StreamingResponse(events(run, first, shape), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


# -- routes --------------------------------------------------------------------------------------------------------


def configured_models(request: Request) -> list[tuple[str, int]]:
    """(name, created) of each configured model; ``created`` is its file's modification time."""
    specs = request.app.state.appliance.config.models
    return [(spec.name, file_identity(spec.path)[3] // 1_000_000_000) for spec in specs]


async def list_models(request: Request) -> JSONResponse:
    return JSONResponse(schema.model_list(configured_models(request)))


async def get_model(request: Request) -> JSONResponse:
    name = request.path_params["model"]
    models = configured_models(request)
    for entry in schema.model_list(models)["data"]:
        if entry["id"] == name:
            return JSONResponse(entry)
    raise ApplianceError("UNKNOWN_MODEL", f"no model named {name!r}",
                         {"model": name, "known": [known for known, _ in models]})


async def chat_completions(request: Request) -> Response:
    options = schema.chat_request(schema.parse_body(await read_body(request)))
    daemon = daemon_of(request)
    model = daemon.resolve(options.model)
    prompt = await asyncio.to_thread(chat_prompt, model.path, options.messages)
    run = Run(request, daemon, options, prompt, stream=options.stream)
    shape = ChatShape(options.model, options.include_usage, "chatcmpl")

    def plain(done: Done) -> dict[str, Any]:
        return schema.chat_completion(shape.ident, shape.created, options.model, done.text, done.finish,
                                      done.usage())

    return await respond(request, run, shape, plain)


async def completions(request: Request) -> Response:
    options = schema.completion_request(schema.parse_body(await read_body(request)))
    daemon = daemon_of(request)
    daemon.resolve(options.model)
    run = Run(request, daemon, options, options.prompt, stream=options.stream)
    shape = CompletionShape(options.model, options.include_usage, "cmpl")

    def plain(done: Done) -> dict[str, Any]:
        return schema.text_completion(shape.ident, shape.created, options.model, done.text, done.finish,
                                      done.usage())

    return await respond(request, run, shape, plain)


routes: list[BaseRoute] = [
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{model:path}", get_model, methods=["GET"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/v1/completions", completions, methods=["POST"]),
]
