"""The Anthropic Messages API: ``POST /v1/messages`` (plain or streamed) and ``POST /v1/messages/count_tokens``.
Requests and responses are checked and shaped by the pure :mod:`appliance.http.anthropic_schema`; a request runs as
the OpenAI surface's chat request does (:mod:`appliance.http.openai`: its template rendering, tool grammar, agents
and generation, :class:`~appliance.http.openai.Run`), so this module only reads, runs and writes. A model whose
template writes ``<think>…</think>`` (``models[].reasoning: split``, the default) has it split out by the chat
path's splitter into a ``thinking`` block before the answer's blocks, as the request's ``thinking`` says
(:func:`appliance.http.anthropic_schema.thinking`).

Every failure of these routes is answered in Anthropic's error envelope (:func:`appliance.http.anthropic_schema.
error_document`, through :func:`appliance.http.errors.error_response`, by path): before a stream starts with its
HTTP status, after it as an ``error`` event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from appliance.daemon.core import Daemon
from appliance.engine import reasoning, toolcalls
from appliance.engine.interface import Token
from appliance.engine.reply import ReplyStream
from appliance.errors import ApplianceError
from appliance.http import anthropic_schema as schema
from appliance.http import chunkwrite, sse
from appliance.http.chunkwrite import ChunkWriter
from appliance.http.jsonreply import JSONReply
from appliance.http.openai import (
    END,
    PING,
    ChatPlan,
    Done,
    Run,
    chat_plan,
    daemon_of,
    first_batch,
    outcome,
    read_body,
)
from appliance.http.openai_schema import ChatRequest, parse_body
from appliance.http.tokencount import count_chat


async def checked(request: Request) -> tuple[Daemon, ChatRequest, dict[str, Any]]:
    """A request's daemon, its body checked as the chat request it runs, and the body."""
    body = parse_body(await read_body(request))
    counting = request.url.path.endswith("/count_tokens")
    options = await asyncio.to_thread(schema.messages_request, body, counting=counting)
    return daemon_of(request), options, body


# -- a finished generation -----------------------------------------------------------------------------------------


def counts(done: Done) -> dict[str, Any]:
    generation = done.generation
    total = generation.prompt_tokens
    cached = 0 if generation.prompt_evaluated is None else max(0, total - generation.prompt_evaluated)
    return schema.usage(total, generation.generated_tokens, cached)


def ending(done: Done, called: bool, max_tokens: int) -> tuple[str, str | None]:
    """The ``stop_reason`` and ``stop_sequence`` of a finished generation."""
    generation = done.generation
    reason = schema.stop_reason(generation.stop_reason, called, generation.generated_tokens, max_tokens,
                                generation.stop_sequence)
    return reason, generation.stop_sequence if reason == "stop_sequence" else None


def answer(done: Done, ident: str, options: ChatRequest, plan: ChatPlan, display: schema.ThinkingDisplay,
           max_tokens: int) -> dict[str, Any]:
    """The ``message`` of a finished generation: its reasoning split out (if the template writes some), the rest
    parsed for tool calls (if it may call tools)."""
    text = done.generation.text
    thought = None
    if plan.reasoning_markers is not None:
        parts = reasoning.split(text, plan.reasoning_markers, inside=plan.thinking)
        text, thought = parts.content, parts.reasoning
    found: list[toolcalls.ToolCall] = []
    if plan.calls is not None:
        text, found = toolcalls.parse(plan.calls, text, schema.tool_use_id)
    content = schema.content_blocks(text, found, schema.shown_thought(thought, display))
    reason, sequence = ending(done, any(block["type"] == "tool_use" for block in content), max_tokens)
    return schema.message(ident, options.model, content, reason, sequence, counts(done))


# -- streaming -----------------------------------------------------------------------------------------------------


async def events(run: Run, first: Any, ident: str, options: ChatRequest, plan: ChatPlan,
                 display: schema.ThinkingDisplay, max_tokens: int,
                 chunks: ChunkWriter | None = None) -> AsyncIterator[bytes]:
    """The SSE body in Anthropic's order: ``message_start``, each content block's start, deltas and stop (a
    ``ping`` after the first start and for each heartbeat), ``message_delta`` and ``message_stop``; an error after
    the start is one ``error`` event. If the client goes away, the generation is cancelled. With the request's
    ``chunks`` writer, tokens that come while the stream waits for them are written without waking this generator
    (:class:`~appliance.http.sse.TokenWrites`)."""
    parser = None if plan.calls is None else toolcalls.StreamParser(plan.calls, schema.tool_use_id)
    reply = ReplyStream(plan.splitter(), parser)
    blocks = schema.StreamBlocks(display=display)

    def render(batch: Sequence[Token]) -> bytes:
        return b"".join(blocks.feed(reply.feed("".join(token.text for token in batch))))

    writes = sse.TokenWrites(run, render, chunks)
    try:
        out = [schema.message_start(ident, options.model)]
        async for items, last in sse.deliveries(run.queue, first, END, writes.parked):  # ready together: one write
            for item in items:
                if item is PING:
                    out.append(schema.PING)
                elif isinstance(item, bytes):
                    out.append(item)  # tokens rendered by the run's sink
                else:
                    out.append(render(item))
            if out and not last:
                yield b"".join(out)
                out = []
        try:
            done = outcome(run.task)
        except ApplianceError as exc:
            out.append(schema.event("error", schema.error_document(exc)))
            yield b"".join(out)
            return
        out.extend(blocks.feed(reply.finish()))
        out.extend(blocks.finish())
        reason, sequence = ending(done, blocks.called, max_tokens)
        out.extend(schema.message_end(reason, sequence, counts(done)))
        yield b"".join(out)
    finally:
        writes.parked(False)
        if not run.task.done():
            run.cancel.set()  # the client left: the engine stops at its next token


async def messages(request: Request) -> Response:
    daemon, options, body = await checked(request)
    display = schema.thinking(body.get("thinking"))
    model = daemon.resolve(options.model)
    plan = await asyncio.to_thread(chat_plan, model.path, options, model.spec.reasoning)
    run = Run(request, daemon, options, plan.prompt, grammar=plan.grammar, surface="anthropic")
    ident = schema.message_id()
    max_tokens = run.max_tokens()
    if run.pump is None:
        await run.watch(request, run.task)
        return JSONReply(answer(outcome(run.task), ident, options, plan, display, max_tokens))
    first = await first_batch(request, run)
    chunks = chunkwrite.writer_of(request.scope)
    return sse.EventStream(events(run, first, ident, options, plan, display, max_tokens, chunks), run.cancel.set)


# -- counting ------------------------------------------------------------------------------------------------------


async def count_tokens(request: Request) -> JSONResponse:
    daemon, options, _ = await checked(request)
    return JSONResponse({"input_tokens": await count_chat(daemon, options)})


routes: list[BaseRoute] = [
    Route("/v1/messages", messages, methods=["POST"]),
    Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
]
