"""The admin page's login form, for an appliance with ``http.api_token``: the typed token, when right, becomes a
session cookie (an HMAC of it, HttpOnly, SameSite=Strict); see :mod:`appliance.http.security`."""

from __future__ import annotations

import hmac
from html import escape
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from appliance.http.security import LOGIN_PATH, SESSION_COOKIE, session_value

MAX_FORM_BYTES = 4096
PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>appliance: log in</title></head>
<body style="font-family: sans-serif; max-width: 24rem; margin: 3rem auto; padding: 0 1rem">
<h1>appliance</h1>
<p>This appliance requires its API token (<code>http.api_token</code> in appliance.yaml).</p>
<form method="post" action="/admin/login">
<label>API token <input type="password" name="token" autocomplete="current-password" required></label>
<button type="submit">Log in</button>
</form>
<p role="alert" style="color: #b00020">{message}</p>
</body></html>
"""


def page(message: str = "", status_code: int = 200) -> HTMLResponse:
    return HTMLResponse(PAGE.format(message=escape(message)), status_code=status_code)


async def login_form(request: Request) -> Response:
    return page()


async def log_in(request: Request) -> Response:
    appliance = request.app.state.appliance
    token = appliance.config.http.api_token
    body = await request.body()
    given = parse_qs(body[:MAX_FORM_BYTES].decode("utf-8", "replace")).get("token", [""])[0]
    if not token:
        return RedirectResponse("/admin/", status_code=303)  # nothing to log in to
    if not hmac.compare_digest(given.encode(), token.encode()):
        return page("That is not the API token.", status_code=401)
    response = RedirectResponse("/admin/", status_code=303)
    response.set_cookie(SESSION_COOKIE, session_value(appliance.session_secret, token), httponly=True,
                        samesite="strict", path="/")
    return response


routes = [
    Route(LOGIN_PATH, login_form, methods=["GET"]),
    Route(LOGIN_PATH, log_in, methods=["POST"]),
]
