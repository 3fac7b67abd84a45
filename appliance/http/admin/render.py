"""What every admin view shares: the Jinja2 environment (the ``templates/`` folder, autoescaped), full pages in the
base layout (nav, the CSRF token for htmx), fragments, form reading with a size limit, and action results.

An action (a form's POST) answers with a fragment for the form's result area: 200 whether the daemon did it or
refused with a P4 error (the error is the result to show, so htmx swaps it in and the browser logs no failed
request); the ``X-Appliance-Outcome`` header carries ``ok`` or the error's code, and a success also sends
``HX-Trigger: appliance-changed`` so the page's listings refresh.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import HTMLResponse

from appliance.errors import ApplianceError
from appliance.http.admin import figures
from appliance.http.assets import templates_dir

if TYPE_CHECKING:
    import jinja2

    from appliance.daemon.core import Daemon

MAX_FORM_BYTES = 8192
"""The largest admin form body read; a bigger one is refused with BAD_REQUEST."""

NAV = (
    ("dashboard", "/admin/", "Dashboard"),
    ("registry", "/admin/registry", "Registry"),
    ("device", "/admin/device", "Device"),
    ("config", "/admin/config", "Config"),
    ("benchmarks", "/admin/benchmarks", "Benchmarks"),
    ("chat", "/admin/chat", "Chat"),
)

CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                           "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'")
"""No inline scripts or styles, nothing from elsewhere, never inside another site's frame (clickjacking)."""

HEADERS = {"Cache-Control": "no-store", "Content-Security-Policy": CONTENT_SECURITY_POLICY, "X-Frame-Options": "DENY",
           "X-Content-Type-Options": "nosniff", "Referrer-Policy": "same-origin"}
OUTCOME_HEADER = "X-Appliance-Outcome"
CHANGED_EVENT = "appliance-changed"


@functools.cache
def environment() -> jinja2.Environment:
    """Built on the first page a browser asks for (an appliance nobody administers never imports Jinja2)."""
    import jinja2

    env = jinja2.Environment(loader=jinja2.FileSystemLoader(templates_dir()), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
    env.filters["bytes"] = figures.format_bytes
    env.filters["seconds"] = figures.format_seconds
    env.filters["when"] = figures.format_time
    env.filters["clock"] = figures.format_clock
    return env


def render(template: str, **context: Any) -> str:
    return environment().get_template(template).render(**context)


def page(request: Request, template: str, active: str, **context: Any) -> HTMLResponse:
    """A full page in the base layout; ``active`` names its nav entry."""
    appliance = request.app.state.appliance
    html = render(template, nav=NAV, active=active, csrf_headers={"X-CSRF-Token": appliance.csrf_token},
                  logout=bool(appliance.config.http.api_token),  # a logout button where there is a login
                  version=appliance.version, **context)
    return HTMLResponse(html, headers=HEADERS)


def fragment(template: str, headers: dict[str, str] | None = None, **context: Any) -> HTMLResponse:
    """An htmx fragment (a ``_partial.html`` template)."""
    return HTMLResponse(render(template, **context), headers={**HEADERS, **(headers or {})})


def result(message: str, error: ApplianceError | None = None) -> HTMLResponse:
    """An action's result for its form's result area (see the module docstring): ``message`` on success, else the
    P4 error with its details (a ledger denial's figures by name)."""
    return fragment("_result.html", headers=outcome_headers(error), **result_context(message, error))


def outcome_headers(error: ApplianceError | None) -> dict[str, str]:
    """An action's response headers: its outcome, and on success the event that refreshes the page's listings."""
    if error is not None:
        return {OUTCOME_HEADER: error.code}
    return {OUTCOME_HEADER: "ok", "HX-Trigger": CHANGED_EVENT}


def result_context(message: str, error: ApplianceError | None) -> dict[str, Any]:
    """What ``_result.html`` shows."""
    denial = figures.denial_figures(error.details) if error is not None and error.code == "VRAM_LEDGER_DENY" else []
    return {"message": message, "error": error, "denial": denial}


async def form_fields(request: Request) -> dict[str, str]:
    """The urlencoded form of an admin POST (each field's first value), at most :data:`MAX_FORM_BYTES`."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise ApplianceError("BAD_REQUEST", f"the form is larger than {MAX_FORM_BYTES} bytes",
                                 {"max_form_bytes": MAX_FORM_BYTES})
    fields = parse_qs(body.decode("utf-8", "replace"), keep_blank_values=True)
    return {name: values[0].strip() for name, values in fields.items()}


def required(fields: dict[str, str], name: str, max_chars: int = 256) -> str:
    """A form field that must be present and non-empty, at most ``max_chars`` characters; else BAD_REQUEST."""
    value = fields.get(name, "")
    if not value:
        raise ApplianceError("BAD_REQUEST", f"{name} is required", {"field": name})
    if len(value) > max_chars:
        raise ApplianceError("BAD_REQUEST", f"{name} is longer than {max_chars} characters",
                             {"field": name, "max_chars": max_chars})
    return value


def daemon_of(request: Request) -> Daemon:
    """The running daemon (SHUTTING_DOWN while there is none: before start, after stop)."""
    daemon = request.app.state.appliance.daemon
    if daemon is None:
        raise ApplianceError("SHUTTING_DOWN", "the daemon is not running")
    return daemon
