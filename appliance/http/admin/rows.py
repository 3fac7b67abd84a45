"""The per-row buttons of the models and agents tables (the dashboard's and the registry's): Load (the daemon's
``acquire``, without an agent), Unload (``Daemon.unload``, refused while an agent or a request holds the model) and
Unregister (``Daemon.unregister``). Each is a POST that carries the page's CSRF header (from the layout), with the
row's model or agent as its form field, and answers the table's own fragment, re-rendered, with the action's result
swapped out of band into the page's ``#row-result`` area (a P4 error, a ledger denial's figures included, is the
result to show: 200 either way, the outcome in ``X-Appliance-Outcome``)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from appliance.daemon.core import Daemon
from appliance.errors import ApplianceError
from appliance.http.admin import dashboard, registry, render
from appliance.protocol import paging

Action = Callable[[Daemon, dict[str, str]], Awaitable[str]]


async def load(daemon: Daemon, fields: dict[str, str]) -> str:
    return await registry.load_model(daemon, render.required(fields, "model", max_chars=registry.MAX_MODEL_CHARS))


async def unload(daemon: Daemon, fields: dict[str, str]) -> str:
    return await registry.unload_model(daemon, render.required(fields, "model", max_chars=registry.MAX_MODEL_CHARS))


async def unregister(daemon: Daemon, fields: dict[str, str]) -> str:
    return await registry.unregister_agent(daemon, registry.agent_field(fields))


ACTIONS: dict[str, tuple[Action, str]] = {
    "load": (load, "Load failed."),
    "unload": (unload, "Unload failed."),
    "unregister": (unregister, "Unregister failed."),
}
"""A row button's action (its route's last part) -> what it does and the headline of its failure."""

Table = Callable[[Request, Daemon, int], tuple[str, dict[str, Any]]]


def dashboard_table(request: Request, daemon: Daemon, offset: int) -> tuple[str, dict[str, Any]]:
    return "_dashboard.html", dashboard.figures_of(request.app.state.appliance, offset)


def registry_table(request: Request, daemon: Daemon, offset: int) -> tuple[str, dict[str, Any]]:
    return "_registry.html", registry.listing(daemon, offset)


async def act(request: Request, action: str, table: Table) -> Response:
    """Run ``action`` with the form's fields and answer ``table``'s fragment with the result out of band."""
    run, failure = ACTIONS[action]
    error: ApplianceError | None = None
    try:
        daemon = render.daemon_of(request)
        fields = await render.form_fields(request)
        message = await run(daemon, fields)
    except ApplianceError as exc:
        error, message = exc, failure
    offset = paging.parse_offset(request.query_params.get("offset"))
    html = ""
    if request.app.state.appliance.daemon is not None:
        template, context = table(request, request.app.state.appliance.daemon, offset)
        html = render.render(template, **context)
    html += render.render("_row_result.html", **render.result_context(message, error))
    return HTMLResponse(html, headers={**render.HEADERS, **render.outcome_headers(error)})


def view(action: str, table: Table) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        return await act(request, action, table)

    return endpoint


routes = [
    *(Route(f"/admin/_dashboard/{action}", view(action, dashboard_table), methods=["POST"]) for action in ACTIONS),
    *(Route(f"/admin/registry/_tables/{action}", view(action, registry_table), methods=["POST"])
      for action in ACTIONS),
]
