"""The dashboard's live log tail: the newest lines the appliance logged
(:class:`~appliance.supervisor.logtail.LogTail`, secrets already redacted), in the ``_log.html`` fragment. The page
polls ``/admin/_log?seen=N`` every :data:`POLL_S` seconds with the number of the newest line it shows: 204 while
nothing newer was logged (htmx keeps the panel, and where the reader scrolled), else the panel again with the new
lines at its bottom. Every line is HTML-escaped (the templates autoescape)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from appliance.http.admin import render
from appliance.supervisor.logtail import LogTail

POLL_S = 2
SHOWN_LINES = 100
"""The newest lines the panel shows (the tail keeps more)."""


def tail_of(tail: LogTail) -> dict[str, Any]:
    """What the panel shows: the newest :data:`SHOWN_LINES` lines, oldest first, and the newest one's number."""
    lines = tail.lines()[-SHOWN_LINES:]
    return {"lines": lines, "last_seq": lines[-1].seq if lines else 0, "shown": SHOWN_LINES, "poll_s": POLL_S}


def seen_of(text: str | None) -> int | None:
    """The ``seen`` query parameter: a line number, or None when absent or not one (then the panel is sent)."""
    if text is None or not text.isascii() or not text.isdigit() or len(text) > 18:
        return None
    return int(text)


async def log_partial(request: Request) -> Response:
    tail: LogTail = request.app.state.appliance.log_tail
    shown = tail_of(tail)
    if seen_of(request.query_params.get("seen")) == shown["last_seq"]:
        return Response(status_code=204, headers=render.HEADERS)
    return render.fragment("_log.html", log=shown)


routes = [Route("/admin/_log", log_partial, methods=["GET"])]
