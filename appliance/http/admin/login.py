"""The admin page's login form, for an appliance with ``http.api_token``: the typed token, when right, becomes a
session cookie (an HMAC of it, HttpOnly, SameSite=Strict, and Secure when the login came over HTTPS; over plain
HTTP only a loopback client may log in); see :mod:`appliance.http.security`. Wrong tokens are throttled
(:class:`~appliance.http.loginthrottle.LoginThrottle`); ``POST /admin/logout`` clears the cookie.

The form's answers are the login page for a browser (a client that accepts HTML) and the P4 error otherwise."""

from __future__ import annotations

import hashlib
import hmac
import math
from base64 import b64encode
from html import escape
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from appliance.errors import ApplianceError
from appliance.http.errors import error_response
from appliance.http.loginthrottle import LoginThrottle
from appliance.http.security import LOGIN_PATH, SESSION_COOKIE, is_loopback, session_value

MAX_FORM_BYTES = 4096
LOGOUT_PATH = "/admin/logout"
STYLE = ("body { font-family: sans-serif; max-width: 24rem; margin: 3rem auto; padding: 0 1rem; } "
         "[role=alert] { color: #b00020; }")
PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>appliance: log in</title><style>{style}</style></head>
<body>
<h1>appliance</h1>
<p>This appliance requires its API token (<code>http.api_token</code> in appliance.yaml).</p>
<form method="post" action="/admin/login">
<label>API token <input type="password" name="token" autocomplete="current-password" required></label>
<button type="submit">Log in</button>
</form>
<p role="alert">{message}</p>
</body></html>
"""
STYLE_HASH = b64encode(hashlib.sha256(STYLE.encode()).digest()).decode()
HEADERS = {
    "Content-Security-Policy": f"default-src 'none'; style-src 'sha256-{STYLE_HASH}'; form-action 'self'; "
                               "frame-ancestors 'none'; base-uri 'none'",
    "X-Frame-Options": "DENY",
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}
"""The login page's own style only (by its hash: no inline style attributes), never framed, never cached."""


def accepts_html(request: Request) -> bool:
    return "text/html" in request.headers.get("accept", "")


def page(message: str = "", status_code: int = 200, headers: dict[str, str] | None = None) -> HTMLResponse:
    return HTMLResponse(PAGE.format(style=STYLE, message=escape(message)), status_code=status_code,
                        headers={**HEADERS, **(headers or {})})


def refused(request: Request, error: ApplianceError, headers: dict[str, str] | None = None) -> Response:
    """A refused login: the page with the error's message for a browser, else the P4 error."""
    if accepts_html(request):
        return page(error.message, status_code=error.http_status, headers=headers)
    response = error_response(error, request)
    response.headers.update({**HEADERS, **(headers or {})})
    return response


def client_of(request: Request) -> str:
    return request.client.host if request.client is not None else "unknown"


def secure_cookie(request: Request) -> bool:
    """The session cookie is ``Secure`` when the login came over HTTPS (a TLS proxy in front of the appliance says so
    with ``X-Forwarded-Proto``, which uvicorn trusts from loopback). Over plain HTTP only a loopback client may log
    in (:func:`in_clear`), and its cookie never leaves the box."""
    return request.url.scheme == "https"


def in_clear(request: Request) -> bool:
    """A login over plain HTTP from another machine: the token, then the session, would cross the network in
    clear, and a ``Secure`` cookie would not come back over HTTP (the browser would loop to this form)."""
    return request.url.scheme != "https" and not is_loopback(client_of(request))


async def form_body(request: Request) -> bytes:
    """The login form's body, at most :data:`MAX_FORM_BYTES` (BAD_REQUEST beyond: a token is never that long)."""
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_FORM_BYTES:
            raise ApplianceError("BAD_REQUEST", f"the login form is larger than {MAX_FORM_BYTES} bytes",
                                 {"max_form_bytes": MAX_FORM_BYTES})
    return bytes(body)


async def login_form(request: Request) -> Response:
    return page()


async def log_in(request: Request) -> Response:
    appliance = request.app.state.appliance
    throttle: LoginThrottle = request.app.state.login_throttle
    token = appliance.config.http.api_token
    if not token:
        return RedirectResponse("/admin/", status_code=303, headers=HEADERS)  # nothing to log in to
    client = client_of(request)
    wait_s = throttle.retry_after(client)
    if wait_s > 0:
        error = ApplianceError("UNAUTHORIZED", f"Too many wrong tokens: try again in {math.ceil(wait_s)} s.",
                               {"retry_after_s": round(wait_s, 3)})
        return refused(request, error, {"Retry-After": str(math.ceil(wait_s))})
    if in_clear(request):
        return refused(request, ApplianceError(
            "FORBIDDEN", "Log in over HTTPS: from another machine the token would cross the network in clear. Put a "
                         "TLS proxy in front of the appliance, or reach it through an SSH tunnel to the box's "
                         "127.0.0.1.", {"scheme": request.url.scheme}))
    given = parse_qs((await form_body(request)).decode("utf-8", "replace")).get("token", [""])[0]
    if not hmac.compare_digest(given.encode(), token.encode()):
        throttle.failed(client)
        return refused(request, ApplianceError("UNAUTHORIZED", "That is not the API token.", {"field": "token"}))
    throttle.succeeded(client)
    response = RedirectResponse("/admin/", status_code=303, headers=HEADERS)
    response.set_cookie(SESSION_COOKIE, session_value(appliance.session_secret, token), httponly=True,
                        samesite="strict", path="/", secure=secure_cookie(request))
    return response


async def log_out(request: Request) -> Response:
    """Clear the session cookie (the guard checked the CSRF token, as for every admin POST); htmx then goes to the
    login form (``HX-Redirect``)."""
    response = Response(status_code=200, headers={**HEADERS, "HX-Redirect": LOGIN_PATH})
    response.delete_cookie(SESSION_COOKIE, path="/", httponly=True, samesite="strict", secure=secure_cookie(request))
    return response


routes = [
    Route(LOGIN_PATH, login_form, methods=["GET"]),
    Route(LOGIN_PATH, log_in, methods=["POST"]),
    Route(LOGOUT_PATH, log_out, methods=["POST"]),
]
