"""The admin page (SPEC W4): server-rendered Jinja2 pages with htmx, one view module per page (datasette style),
their htmx fragments as ``_partial.html`` templates; state changes are POSTs that carry the CSRF header (see
:mod:`appliance.http.security`). ``/`` redirects to ``/admin/``."""

from __future__ import annotations

from starlette.routing import BaseRoute

from appliance.http.admin import (
    addmodel,
    benchmarks,
    chat,
    configuration,
    dashboard,
    device,
    login,
    registry,
    rows,
    tail,
)

routes: list[BaseRoute] = [
    *login.routes,
    *dashboard.routes,
    *registry.routes,
    *rows.routes,
    *addmodel.routes,
    *tail.routes,
    *device.routes,
    *configuration.routes,
    *benchmarks.routes,
    *chat.routes,
]
