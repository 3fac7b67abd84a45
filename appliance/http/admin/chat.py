"""The chat page: a box to try a model. ``web/chat.js`` POSTs to the OpenAI endpoint ``/v1/chat/completions``
with ``stream: true`` and shows the tokens as their SSE chunks arrive; an agent id, when given, is sent as the
``user`` field (the appliance then keeps that conversation, and its KV, between turns). Optional tool definitions
(a JSON array) go as ``tools`` with the chosen ``tool_choice``; a reply that calls a tool is shown as the call (the
function's name and its pretty-printed arguments), and the call goes back in the next turn's history."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from appliance.http.admin import pickers, render

DEFAULT_MAX_TOKENS = 64


async def chat(request: Request) -> Response:
    daemon = render.daemon_of(request)
    return render.page(request, "chat.html", "chat", model_groups=pickers.model_groups(daemon.config),
                       max_tokens=DEFAULT_MAX_TOKENS)


routes = [Route("/admin/chat", chat, methods=["GET"])]
