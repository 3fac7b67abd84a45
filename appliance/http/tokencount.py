"""A chat request's prompt tokens without running it, for the APIs that count them (the Responses API's
``input_tokens``, Anthropic's ``count_tokens``): the prompt rendered as its generation's would be (the model's chat
template, its tools), counted by :meth:`appliance.daemon.core.Daemon.count` on the model's vocabulary."""

from __future__ import annotations

import asyncio

from appliance.daemon.core import Daemon
from appliance.http.openai import chat_plan
from appliance.http.openai_schema import ChatRequest


async def count_chat(daemon: Daemon, request: ChatRequest) -> int:
    """The tokens ``request``'s prompt is on its model, its BOS token included (its generation's ``prompt_tokens``)."""
    model = daemon.resolve(request.model)
    plan = await asyncio.to_thread(chat_plan, model.path, request, model.spec.reasoning)
    return await daemon.count(request.model, plan.prompt)
