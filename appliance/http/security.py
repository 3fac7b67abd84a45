"""Who may use the HTTP surface (SPEC W5): :class:`Guard`, one ASGI middleware in front of every route.

* **API token.** With ``http.api_token`` set (required by the config for any non-loopback ``http.host``), every
  request must carry it: ``Authorization: Bearer <token>`` (API clients, Prometheus), or the session cookie that
  ``POST /admin/login`` sets after the token was typed into the login form (a browser). Both are compared in
  constant time; the token is never logged or echoed. Only the login form itself is reachable without it.
  Otherwise: 401 ``UNAUTHORIZED`` (a browser's GET of an admin page is sent to the login form instead).
* **Cross-origin.** A state-changing request (POST, PUT, PATCH, DELETE) whose ``Origin`` is not this server's
  own address, or that the browser marks ``Sec-Fetch-Site: cross-site``, is refused: 403 ``FORBIDDEN``. So a
  web page elsewhere cannot drive the appliance through a visitor's browser, even with a plain form.
* **CSRF token.** A state-changing admin request (under ``/admin/``) must also carry the page's CSRF token in
  the ``X-CSRF-Token`` header (the admin page's htmx sends it on every request); else 403 ``FORBIDDEN``.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from appliance.errors import ApplianceError
from appliance.http.errors import error_response

if TYPE_CHECKING:
    from appliance.app import Appliance

SESSION_COOKIE = "appliance_session"
CSRF_HEADER = "x-csrf-token"
LOGIN_PATH = "/admin/login"
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def session_value(secret: bytes, token: str) -> str:
    """The session cookie's value for ``token``: an HMAC under this process's ``secret`` (never the token)."""
    return hmac.new(secret, token.encode(), hashlib.sha256).hexdigest()


def bearer(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value:
        return None
    return value.strip()


def authorized(request: Request, token: str, secret: bytes) -> bool:
    """The request carries ``token`` (bearer) or a session cookie made for it; constant-time comparisons."""
    given = bearer(request)
    if given is not None and hmac.compare_digest(given.encode(), token.encode()):
        return True
    cookie = request.cookies.get(SESSION_COOKIE)
    return cookie is not None and hmac.compare_digest(cookie.encode(), session_value(secret, token).encode())


def cross_origin(request: Request) -> bool:
    """A browser says the request comes from another origin (``Origin`` that is not our ``Host``, the opaque
    ``null`` origin, or ``Sec-Fetch-Site: cross-site``). Clients that send neither header (curl, SDKs) pass."""
    if request.headers.get("sec-fetch-site") == "cross-site":
        return True
    origin = request.headers.get("origin")
    if origin is None:
        return False
    if origin == "null":
        return True
    return urlsplit(origin).netloc.lower() != request.headers.get("host", "").lower()


def wants_page(request: Request) -> bool:
    """A browser asking for an admin page (a GET that accepts HTML): sent to the login form, not a JSON 401."""
    return (request.method == "GET" and request.url.path.startswith("/admin")
            and "text/html" in request.headers.get("accept", ""))


def refusal(request: Request, appliance: Appliance) -> ApplianceError | None:
    """Why ``request`` is refused, or None to let it through (see the module docstring)."""
    path = request.url.path
    token = appliance.config.http.api_token
    if token and path != LOGIN_PATH and not authorized(request, token, appliance.session_secret):
        return ApplianceError("UNAUTHORIZED", "this appliance requires its API token: send "
                                              "'Authorization: Bearer <http.api_token>' (or log in at /admin/login)",
                              {"path": path})
    if request.method not in UNSAFE_METHODS:
        return None
    if cross_origin(request):
        return ApplianceError("FORBIDDEN", "cross-origin request refused",
                              {"path": path, "origin": request.headers.get("origin")})
    if path.startswith("/admin/") and path != LOGIN_PATH:
        given = request.headers.get(CSRF_HEADER, "")
        if not hmac.compare_digest(given.encode(), appliance.csrf_token.encode()):
            return ApplianceError("FORBIDDEN", "missing or wrong CSRF token (reload the admin page)",
                                  {"path": path, "header": "X-CSRF-Token"})
    return None


class Guard:
    """ASGI middleware: answer a refused request with its P4 error, pass the others on."""

    def __init__(self, app: ASGIApp, appliance: Appliance) -> None:
        self.app = app
        self.appliance = appliance

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        error = refusal(request, self.appliance)
        if error is not None:
            response: Response = error_response(error, request)
            if error.code == "UNAUTHORIZED" and wants_page(request):
                response = RedirectResponse(LOGIN_PATH, status_code=303)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)
