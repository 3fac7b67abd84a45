"""``POST /v1/embeddings`` (OpenAI's shape): a thin route over :func:`appliance.server.outcome.embed`; the body
and the answer are :mod:`appliance.http.embeddings_schema`'s (docs/openai-api.md says what a client sees)."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Route

from appliance.http import embeddings_schema as schema
from appliance.http.openai import daemon_of, read_body
from appliance.http.openai_schema import parse_body
from appliance.http.refusals import note_logged
from appliance.server.outcome import embed


async def embeddings(request: Request) -> JSONResponse:
    body = parse_body(await read_body(request))
    options = schema.embeddings_request(body)
    daemon = daemon_of(request)
    note_logged(request.scope)  # the request log's record is its access line from here
    result = await embed(daemon, surface="openai", model=options.model, inputs=options.inputs,
                         dimensions=options.dimensions)
    document = await asyncio.to_thread(schema.embeddings_response, options.model, result.vectors,
                                       result.prompt_tokens, options.encoding_format)  # off the loop: large lists
    return JSONResponse(document)


routes: list[BaseRoute] = [Route("/v1/embeddings", embeddings, methods=["POST"])]
