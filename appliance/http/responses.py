"""The OpenAI Responses API: ``POST /v1/responses`` (plain or streamed), ``GET`` and ``DELETE /v1/responses/{id}``,
``POST /v1/responses/input_tokens``. The request and the documents are the pure :mod:`appliance.http.
responses_schema`; the generation is the chat path's (:func:`appliance.http.openai.chat_plan`, :class:`~appliance.
http.openai.Run`): one engine, one ledger, one error mapping.

* **Stored responses are agent conversations.** A response with ``store`` (the default, as OpenAI) and no
  ``previous_response_id`` runs in a new agent named by its own id (``resp_…``, owner none); the store keeps, per
  response, its document and the conversation's messages through it. A follow-up naming it with
  ``previous_response_id`` runs in that agent, its prompt the whole history re-rendered (``history``): the engine keeps
  the common token prefix and evaluates only the new turn (``input_tokens_details.cached_tokens``). A stored
  response lives as long as its agent (``agent_idle_ttl_s`` expires both; ``max_agents`` refuses a new chain with
  ``TOO_MANY_AGENTS``); ``DELETE`` unregisters the agent once no stored response uses it. A stored response is
  committed to the agents' store with its agent before it is answered, so it outlives a restart
  (:mod:`appliance.daemon.durable`).
* ``store: false`` without ``previous_response_id`` runs on a fresh context, like a chat without ``user``.
* **Reasoning.** A model whose template writes ``<think>…</think>`` (``models[].reasoning: split``, the default) has
  it split out by the chat path's splitter (:meth:`~appliance.http.openai.ChatPlan.splitter`) into a ``reasoning``
  item before the answer; a follow-up's history leaves it out, as those templates do.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from appliance.daemon.core import Daemon
from appliance.daemon.model import Agent
from appliance.daemon.store import dumps
from appliance.engine import toolcalls
from appliance.engine.chat import Message
from appliance.engine.interface import Token
from appliance.engine.reply import ReplyStream
from appliance.errors import ApplianceError
from appliance.http import chunkwrite, sse
from appliance.http import openai_schema as chat_schema
from appliance.http import responses_schema as schema
from appliance.http.errors import error_body
from appliance.http.jsonreply import JSONReply
from appliance.http.openai import (
    END,
    ChatPlan,
    Done,
    Run,
    chat_plan,
    daemon_of,
    first_batch,
    outcome,
    read_body,
)
from appliance.http.tokencount import count_chat


@dataclass(frozen=True)
class Stored:
    """A stored response: its document, the agent whose conversation it is, and that conversation's messages
    through this response (its output included; ``instructions`` apart)."""

    document: dict[str, Any]
    agent: Agent
    messages: tuple[Message, ...]


class Store:
    """The stored responses of one appliance, each alive while its agent is (the same registration)."""

    def __init__(self) -> None:
        self.responses: dict[str, Stored] = {}

    def alive(self, daemon: Daemon, stored: Stored) -> bool:
        return daemon.agents.get(stored.agent.id) is stored.agent

    def prune(self, daemon: Daemon) -> None:
        """Forget the responses whose agent is gone (expired, unregistered, or its model removed)."""
        for ident in [ident for ident, stored in self.responses.items() if not self.alive(daemon, stored)]:
            del self.responses[ident]

    def get(self, daemon: Daemon, ident: str, param: str) -> Stored:
        stored = self.responses.get(ident)
        if stored is None:
            stored = self.restored(daemon, ident)
        if stored is not None and not self.alive(daemon, stored):
            self.prune(daemon)
            stored = None
        if stored is None:
            shown = ident[:80]
            raise ApplianceError("NOT_FOUND", f"no stored response {shown!r} (never stored, deleted, or expired "
                                              "with its conversation: agent_idle_ttl_s)",
                                 {"param": param, "response": shown})
        return stored

    def restored(self, daemon: Daemon, ident: str) -> Stored | None:
        """A response stored before the last restart (its agent restored with it), read back once."""
        record = daemon.stored_responses.get(ident)
        agent = None if record is None else daemon.agents.get(record.agent)
        if record is None or agent is None:
            return None
        messages = tuple(message_from_json(item) for item in json.loads(record.messages))
        stored = self.responses[ident] = Stored(json.loads(record.document), agent, messages)
        return stored

    async def put(self, daemon: Daemon, ident: str, stored: Stored) -> None:
        self.prune(daemon)
        self.responses[ident] = stored
        messages = [message_to_json(message) for message in stored.messages]
        await daemon.store_response(ident, stored.agent, dumps(stored.document), dumps(messages))

    async def delete(self, daemon: Daemon, ident: str) -> None:
        """Forget ``ident``; unregister its agent when no other stored response is in its conversation."""
        stored = self.get(daemon, ident, "response_id")
        del self.responses[ident]
        await daemon.drop_response(ident)
        others = [record.agent for key, record in daemon.stored_responses.items() if key not in self.responses]
        if any(other.agent is stored.agent for other in self.responses.values()) or stored.agent.id in others:
            return
        with contextlib.suppress(ApplianceError):  # it expired meanwhile: nothing left to unregister
            await daemon.unregister(stored.agent.id, reason=f"its last stored response {ident} was deleted")


def message_to_json(message: Message) -> dict[str, Any]:
    content: Any = message.content
    if isinstance(content, tuple):
        content = list(content)
    return {"role": message.role, "content": content,
            "tool_calls": [[call.id, call.name, call.arguments] for call in message.tool_calls],
            "tool_call_id": message.tool_call_id, "name": message.name}


def message_from_json(item: dict[str, Any]) -> Message:
    content = item["content"]
    if isinstance(content, list):
        content = tuple(content)
    calls = tuple(toolcalls.ToolCall(*call) for call in item["tool_calls"])
    return Message(item["role"], content, calls, item["tool_call_id"], item["name"])


def store_of(request: Request) -> Store:
    state = request.app.state
    found = getattr(state, "responses_store", None)
    if found is None:
        found = state.responses_store = Store()
    return found


class ResponseRun(Run):
    """The chat path's run in the conversation the Responses API names (None: a fresh context)."""

    def __init__(self, request: Request, daemon: Daemon, options: chat_schema.Options, plan: ChatPlan,
                 conversation: str | None) -> None:
        self.conversation = conversation
        super().__init__(request, daemon, options, plan.prompt, grammar=plan.grammar, surface="responses")
        self.param = "previous_response_id"

    def agent_name(self, request: Request) -> str | None:
        return self.conversation


@dataclass
class Turn:
    """One ``POST /v1/responses``: its request, the history it continues, its id, plan and output so far. The
    reply's text goes through the plan's reasoning splitter (if its template writes reasoning), its answer through
    the call format's parser (if it may call tools)."""

    request: schema.ResponsesRequest
    history: tuple[Message, ...]
    ident: str
    created: int
    plan: ChatPlan
    output: schema.Output
    reply: ReplyStream = field(init=False)  # the reasoning split out first, then the answer parsed for calls

    def __post_init__(self) -> None:
        calls = self.plan.calls
        parser = None if calls is None else toolcalls.StreamParser(calls)
        self.reply = ReplyStream(self.plan.splitter(), parser)

    def feed(self, text: str) -> list[dict[str, Any]]:
        return self.output.feed(self.reply.feed(text))

    def finish(self, done: Done) -> list[dict[str, Any]]:
        tail = self.reply.finish()
        cut = schema.incomplete(done.generation.stop_reason)
        return self.output.feed(tail) + self.output.finish(cut)

    def document(self, status: str, done: Done | None) -> dict[str, Any]:
        counts = None if done is None else usage(done)
        return schema.response(self.ident, self.created, self.request, status, schema.snapshot(self.output.items),
                               counts)

    def completed(self, done: Done) -> dict[str, Any]:
        return self.document("incomplete" if schema.incomplete(done.generation.stop_reason) else "completed", done)


def usage(done: Done) -> dict[str, Any]:
    generation = done.generation
    total = generation.prompt_tokens
    cached = 0 if generation.prompt_evaluated is None else max(0, total - generation.prompt_evaluated)
    return schema.usage(total, generation.generated_tokens, cached)


async def remember(request: Request, daemon: Daemon, turn: Turn, run: Run, document: dict[str, Any]) -> None:
    """Store ``turn``'s response (with ``store``) with its conversation's messages through its output."""
    if not turn.request.store or run.agent_id is None:
        return
    agent = daemon.agents.get(run.agent_id)
    if agent is None:  # its agent expired as it answered: nothing holds the conversation
        return
    output = schema.input_messages(document["output"], "output") if document["output"] else ()
    messages = (*turn.history, *turn.request.input, *output)
    await store_of(request).put(daemon, turn.ident, Stored(document, agent, messages))


async def unregister_after(daemon: Daemon, run: Run, agent_id: str) -> None:
    """Unregister ``agent_id`` once ``run`` has ended (its registration, if it got that far, done)."""
    await asyncio.wait([run.task])
    with contextlib.suppress(ApplianceError):  # never registered, or gone already (expired, the daemon stops)
        await daemon.unregister(agent_id, reason="its response was not stored (it failed, or its client left)")


def release_unstored(request: Request, daemon: Daemon, turn: Turn, run: Run) -> None:
    """Let the agent of a new conversation go when its first response was not stored (it failed, or its client
    left): nothing can name it again, and it would hold a ``max_agents`` place until it expired."""
    if run.agent_id != turn.ident or turn.ident in store_of(request).responses:
        return
    daemon.background(asyncio.ensure_future(unregister_after(daemon, run, run.agent_id)))


async def stream(request: Request, daemon: Daemon, turn: Turn, run: Run, first: Any) -> AsyncIterator[bytes]:
    """The SSE body: ``response.created`` and ``in_progress``, the output's events as tokens come, then
    ``response.completed`` (or ``incomplete``); an error after the start is one ``error`` event. Tokens that come
    while the stream waits for them are written without waking this generator
    (:class:`~appliance.http.sse.TokenWrites`)."""

    def render(batch: Sequence[Token]) -> bytes:
        return b"".join(schema.event(payload) for payload in turn.feed(token_text(batch)))

    writes = sse.TokenWrites(run, render, chunkwrite.writer_of(request.scope))
    try:
        opening = turn.document("in_progress", None)
        out = [schema.event({"type": "response.created", "response": opening, "sequence_number": 0}),
               schema.event({"type": "response.in_progress", "response": opening, "sequence_number": 1})]
        async for items, last in sse.deliveries(run.queue, first, END, writes.parked):  # ready together: one write
            for item in items:
                if isinstance(item, bytes):
                    out.append(item)  # a ping, or tokens rendered by the run's sink
                else:
                    out.append(render(item))
            if out and not last:
                yield b"".join(out)
                out = []
        try:
            done = outcome(run.task)
        except ApplianceError as exc:
            out.append(schema.event(schema.error_event(error_body(exc), turn.output.sequence)))
            yield b"".join(out)
            return
        out.extend(schema.event(payload) for payload in turn.finish(done))
        document = turn.completed(done)
        await remember(request, daemon, turn, run, document)
        kind = "response.completed" if document["status"] == "completed" else "response.incomplete"
        out.append(schema.event({"type": kind, "response": document, "sequence_number": turn.output.sequence}))
        yield b"".join(out)
    finally:
        writes.parked(False)
        if not run.task.done():
            run.cancel.set()  # the client left: the engine stops at its next token
        release_unstored(request, daemon, turn, run)


def token_text(batch: Sequence[Token]) -> str:
    return "".join(token.text for token in batch)


# -- routes --------------------------------------------------------------------------------------------------------


async def prepared(request: Request) -> tuple[Daemon, schema.ResponsesRequest, Stored | None]:
    """A request's checked body and the stored response it continues."""
    body = chat_schema.parse_body(await read_body(request))
    checked = await asyncio.to_thread(schema.responses_request, body)  # off the loop: schemas become grammars
    daemon = daemon_of(request)
    daemon.resolve(checked.options.model)
    previous = None
    if checked.previous_response_id is not None:
        previous = store_of(request).get(daemon, checked.previous_response_id, "previous_response_id")
    return daemon, checked, previous


def history_of(previous: Stored | None) -> tuple[Message, ...]:
    return () if previous is None else previous.messages


async def create_response(request: Request) -> Response:
    daemon, checked, previous = await prepared(request)
    model = daemon.resolve(checked.options.model)
    plan = await asyncio.to_thread(chat_plan, model.path, checked.chat_request(history_of(previous)),
                                   model.spec.reasoning)
    ident = schema.new_id("resp")
    conversation = previous.agent.id if previous is not None else ident if checked.store else None
    turn = Turn(checked, history_of(previous), ident, int(time.time()), plan,
                schema.Output(first_sequence=2, namespaced=checked.namespaced))
    run = ResponseRun(request, daemon, checked.options, plan, conversation)
    if run.pump is None:
        try:
            await run.watch(request, run.task)
            done = outcome(run.task)
            turn.feed(done.generation.text)
            turn.finish(done)
            document = turn.completed(done)
            await remember(request, daemon, turn, run, document)
        finally:
            release_unstored(request, daemon, turn, run)
        return JSONReply(document)
    try:
        first = await first_batch(request, run)
    except BaseException:
        release_unstored(request, daemon, turn, run)
        raise
    return sse.EventStream(stream(request, daemon, turn, run, first), run.cancel.set)


async def get_response(request: Request) -> JSONResponse:
    ident = request.path_params["response_id"]
    return JSONResponse(store_of(request).get(daemon_of(request), ident, "response_id").document)


async def delete_response(request: Request) -> JSONResponse:
    ident = request.path_params["response_id"]
    await store_of(request).delete(daemon_of(request), ident)
    return JSONResponse(schema.deleted(ident))


async def input_tokens(request: Request) -> JSONResponse:
    """The tokens the input of a request would be, with the history it continues and its tools (nothing runs)."""
    daemon, checked, previous = await prepared(request)
    return JSONResponse(schema.input_tokens(await count_chat(daemon, checked.chat_request(history_of(previous)))))


routes: list[BaseRoute] = [
    Route("/v1/responses", create_response, methods=["POST"]),
    Route("/v1/responses/input_tokens", input_tokens, methods=["POST"]),
    Route("/v1/responses/{response_id}", get_response, methods=["GET"]),
    Route("/v1/responses/{response_id}", delete_response, methods=["DELETE"]),
]
