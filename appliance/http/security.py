"""Who may use the HTTP surface (SPEC W5): :class:`Guard`, one ASGI middleware in front of every route.

* **Host allow-list (DNS rebinding).** A request must address the appliance by a name it answers to, checked on
  every path before anything else: a loopback name or address (``localhost``, ``*.localhost``, 127.0.0.0/8,
  ``::1``), ``http.host`` itself (``0.0.0.0`` too: the URL the appliance advertises then), the IP address the
  request arrived on (so a box bound to ``0.0.0.0`` answers to its own addresses; names need the next item), or a
  name of ``http.allowed_hosts`` (``*.example.com``: its subdomains; ``*``: any name). Else 403 ``FORBIDDEN``: a
  page on ``http://evil.example:PORT`` whose name an attacker rebound to 127.0.0.1 is same-origin for the browser,
  and its requests carry ``Host: evil.example``. The port in ``Host`` is not compared. A ``Host`` that is no name
  or address (with an optional port) is a 400 ``BAD_REQUEST``. A request without ``Host`` (HTTP/1.0; HTTP/1.1
  requires one) is served as addressed to the address it arrived on: browsers always send ``Host``, so it cannot
  come from a rebound page.
* **API token.** With ``http.api_token`` set (required by the config for any non-loopback ``http.host``), every
  request must carry it: ``Authorization: Bearer <token>`` (API clients, Prometheus), ``x-api-key: <token>``
  (Anthropic's clients), or the session cookie that
  ``POST /admin/login`` sets after the token was typed into the login form (a browser). Both are compared in
  constant time; the token is never logged or echoed. Only the login form itself is reachable without it, and,
  with ``http.scrape_without_token``, a GET of ``/metrics``, ``/v1/health`` or ``/health`` (for scrapers and
  routers that cannot send a token). Otherwise: 401 ``UNAUTHORIZED`` (a browser's GET of an admin page is sent to
  the login form instead).
* **Cross-origin.** A state-changing request (POST, PUT, PATCH, DELETE) is refused with 403 ``FORBIDDEN`` when
  the browser marks it ``Sec-Fetch-Site: cross-site`` or its ``Origin`` is not ``http(s)://NAME:PORT`` with a
  NAME the allow-list above accepts and the PORT this server listens on (or, behind a reverse proxy, the port the
  request's own allowed ``Host`` names). So a web page elsewhere, even on another local port, cannot drive the
  appliance through a visitor's browser. Clients that send no ``Origin`` (curl, SDKs) pass. The exception: a page
  of an origin in ``http.cors_origins`` may call the API (``/v1/…``, ``/health``; :mod:`appliance.http.cors`
  answers its preflights and adds the CORS headers), with the API token in a header: a cross-origin request is
  never authorized by the session cookie.
* **CSRF token.** A state-changing admin request (under ``/admin/``) must also carry the page's CSRF token in
  the ``X-CSRF-Token`` header (the admin page's htmx sends it on every request); else 403 ``FORBIDDEN``.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import ipaddress
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request, cookie_parser
from starlette.responses import RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.errors import ApplianceError
from appliance.http import cors, refusals
from appliance.http.errors import error_response

if TYPE_CHECKING:
    from appliance.app import Appliance
    from appliance.config.types import HttpConfig

SESSION_COOKIE = "appliance_session"
CSRF_HEADER = "x-csrf-token"
API_KEY_HEADER = "x-api-key"
LOGIN_PATH = "/admin/login"
UNSAFE_METHODS = frozenset({"POST", "PUT", "PATCH", "DELETE"})
SCRAPE_PATHS = frozenset({"/metrics", "/v1/health", "/health"})
"""What ``http.scrape_without_token`` opens: the metrics page and the health document (``/health`` is the same
document as ``/v1/health``, where probes look for it)."""
SCRAPE_METHODS = frozenset({"GET", "HEAD"})
MAX_SHOWN_CHARS = 64
"""A refused ``Host`` or ``Origin`` is echoed in the error's details cut to this many characters."""
DEFAULT_PORTS = {"http": 80, "https": 443}
UNSPECIFIED_HOSTS = frozenset({"0.0.0.0", "::", "[::]"})
"""``http.host`` values that bind every address: they name no host a request could address."""

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_DNS_NAME = re.compile(r"[a-z0-9_](?:[a-z0-9_.-]{0,252})", re.ASCII)
_PORT = re.compile(r"[0-9]{1,5}", re.ASCII)


def shown(text: str) -> str:
    """Attacker-chosen ``text`` as an error may echo it: at most :data:`MAX_SHOWN_CHARS` characters."""
    return text[:MAX_SHOWN_CHARS]


@dataclass(frozen=True)
class Authority:
    """The ``name[:port]`` of a ``Host`` header or an ``Origin``: ``name`` lower-cased, without a trailing dot; an
    IPv6 address in brackets (``[::1]``); ``port`` None when not given."""

    name: str
    port: int | None


def parse_authority(text: str) -> Authority | None:
    """``text`` (``name``, ``name:port``, ``[v6]`` or ``[v6]:port``) as an :class:`Authority`; None if it is
    none (no name, an unbracketed IPv6, a port that is not 0-65535, characters no host name has)."""
    text = text.strip().lower()
    if text.startswith("["):
        address, bracket, rest = text[1:].partition("]")
        if not bracket or _v6(address) is None:
            return None
        name = f"[{address}]"
    else:
        name, _, port_text = text.partition(":")
        rest = text[len(name):]
        name = name.removesuffix(".")
        if not _DNS_NAME.fullmatch(name) or ".." in name:
            return None
    if not rest:
        return Authority(name, None)
    port_text = rest.removeprefix(":")
    if not rest.startswith(":") or not _PORT.fullmatch(port_text) or int(port_text) > 65535:
        return None
    return Authority(name, int(port_text))


def _v6(text: str) -> ipaddress.IPv6Address | None:
    try:
        return ipaddress.IPv6Address(text)
    except ValueError:
        return None


def address_of(name: str) -> IPAddress | None:
    """The IP address ``name`` spells (``127.0.0.1``, ``[::1]`` or ``::1``), an IPv4-mapped IPv6 as its IPv4;
    None for a DNS name."""
    text = name.removeprefix("[").removesuffix("]").split("%", 1)[0]
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def is_loopback(name: str) -> bool:
    """``name`` is a loopback name (``localhost``, ``*.localhost``) or address (127.0.0.0/8, ``::1``)."""
    address = address_of(name)
    if address is not None:
        return address.is_loopback
    name = name.lower().removesuffix(".")
    return name == "localhost" or name.endswith(".localhost")


@dataclass(frozen=True)
class HostRule:
    """The names requests may address (module docstring): loopback, ``bind`` (``http.host``) unless it is an
    any-address bind, the address a request arrived on, and ``allowed`` (``http.allowed_hosts``, lower-cased)."""

    bind: str
    allowed: tuple[str, ...] = ()

    @classmethod
    def of(cls, http: HttpConfig) -> HostRule:
        return cls(http.host.lower(), http.allowed_hosts)

    def allows(self, name: str, arrived_on: str | None = None) -> bool:
        """``name`` (an :class:`Authority`'s) is one the appliance answers to; ``arrived_on``: the local address of
        the request's connection."""
        if "*" in self.allowed or is_loopback(name):
            return True
        address = address_of(name)
        if address is not None:
            arrived = address_of(arrived_on) if arrived_on else None
            named = [address_of(entry) for entry in (self.bind, *self.allowed)]
            return address == arrived or address in named
        return name == self.bind or any(_matches(name, entry) for entry in self.allowed)

    def refusal(self, host: str | None, arrived_on: str | None) -> ApplianceError | None:
        """Why a request with this ``Host`` header is refused, or None (no header: see the module docstring)."""
        if host is None:
            return None
        authority = parse_authority(host)
        if authority is None:
            return ApplianceError("BAD_REQUEST", "the Host header is not a host name or address with an optional "
                                                 "port", {"host": shown(host)})
        if self.allows(authority.name, arrived_on):
            return None
        hint = ""
        if self.bind in UNSPECIFIED_HOSTS:
            hint = f" (http.host {self.bind} answers to loopback and to the address a request arrives on, not to names)"
        return ApplianceError("FORBIDDEN", "this appliance does not answer to that host name (DNS rebinding "
                                           f"protection): add it to http.allowed_hosts in its config{hint}",
                              {"host": shown(authority.name)})

    def origin_allowed(self, origin: str, port: int | None, host: str | None, arrived_on: str | None) -> bool:
        """``origin`` (an ``Origin`` header) names an allowed host (:meth:`allows`) and ``port``, the port this
        server listens on, or the port of the request's own ``host`` (a reverse proxy's)."""
        scheme, separator, rest = origin.partition("://")
        default_port = DEFAULT_PORTS.get(scheme)
        authority = parse_authority(rest) if separator and default_port is not None else None
        if authority is None or not self.allows(authority.name, arrived_on):
            return False
        origin_port = authority.port or default_port
        addressed = parse_authority(host) if host is not None else None
        proxied = addressed is not None and addressed.name == authority.name and \
            (addressed.port or default_port) == origin_port
        return origin_port == port or proxied


def _matches(name: str, entry: str) -> bool:
    """``name`` matches an ``http.allowed_hosts`` entry: the same name, or a subdomain of ``*.domain``."""
    if entry.startswith("*."):
        return name.endswith(entry[1:]) and len(name) > len(entry) - 1
    return name == entry.removesuffix(".")


def session_value(secret: bytes, token: str) -> str:
    """The session cookie's value for ``token``: an HMAC under this process's ``secret`` (never the token)."""
    return hmac.new(secret, token.encode(), hashlib.sha256).hexdigest()


class HeadHeaders(Mapping[str, str]):
    """A request's headers by lower-cased name, the first of repeated ones (as starlette's ``Headers.get``), each
    value decoded only when it is read: the :class:`Guard` reads a few of them."""

    __slots__ = ("raw",)

    def __init__(self, raw: list[tuple[bytes, bytes]]) -> None:
        self.raw = dict(reversed(raw))  # the first of a repeated name is the last assignment, so it stays

    def __getitem__(self, name: str) -> str:
        return self.raw[name.encode("latin-1")].decode("latin-1")

    def get(self, name: str, default: Any = None) -> Any:
        value = self.raw.get(name.encode("latin-1"))
        if value is None:
            return default
        return value.decode("latin-1")

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.encode("latin-1") in self.raw

    def __iter__(self) -> Iterator[str]:
        return (name.decode("latin-1") for name in self.raw)

    def __len__(self) -> int:
        return len(self.raw)


class RequestHead:
    """What the :class:`Guard` reads of a request, from its ASGI scope: ``path`` as the router matches it, its
    headers (:class:`HeadHeaders`), its cookies (every ``Cookie`` header, as starlette's ``Request.cookies``) and
    the address and port its connection arrived on."""

    __slots__ = ("scope", "method", "path", "headers", "arrived_on", "port")

    def __init__(self, scope: Scope) -> None:
        self.scope = scope
        self.method: str = scope["method"]
        self.path: str = scope["path"]
        self.headers = HeadHeaders(scope["headers"])
        self.arrived_on, self.port = local_address(scope)

    def cookie(self, name: str) -> str | None:
        cookies: dict[str, str] = {}
        for raw_name, raw_value in self.scope["headers"]:
            if raw_name == b"cookie":
                cookies.update(cookie_parser(raw_value.decode("latin-1")))
        return cookies.get(name)


def bearer(head: RequestHead) -> str | None:
    header = head.headers.get("authorization", "")
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer" or not value:
        return None
    return value.strip()


def authorized(head: RequestHead, token: str, secret: bytes, cookie_counts: bool = True) -> bool:
    """The request carries ``token`` (bearer, or the ``x-api-key`` header of Anthropic's clients) or, where
    ``cookie_counts``, a session cookie made for it; constant-time comparisons."""
    for given in (bearer(head), head.headers.get(API_KEY_HEADER)):
        if given and hmac.compare_digest(given.strip().encode(), token.encode()):
            return True
    if not cookie_counts:
        return False
    cookie = head.cookie(SESSION_COOKIE)
    return cookie is not None and hmac.compare_digest(cookie.encode(), session_value(secret, token).encode())


def local_address(scope: Scope) -> tuple[str | None, int | None]:
    """The address and port the request's connection arrived on (uvicorn's ``server``)."""
    server = scope.get("server")
    if not server:
        return None, None
    return server[0], server[1]


HOST_DECISIONS = 256
"""How many (rule, ``Host``, local address) triples :func:`host_accepted` remembers."""


@functools.lru_cache(maxsize=HOST_DECISIONS)
def host_accepted(rule: HostRule, host: str | None, arrived_on: str | None) -> bool:
    """``rule`` lets a request with this ``Host`` header through (:meth:`HostRule.refusal` is None), remembered: a
    client sends the same ``Host`` on every request, and parsing it is most of the Guard's work."""
    return rule.refusal(host, arrived_on) is None


def shown_path(path: str) -> str:
    """``path`` as an error's details show it: as starlette's ``request.url.path`` spells it."""
    return path.replace("?", "%3F").replace("#", "%23").replace("\\", "%5C")


def cross_origin(head: RequestHead, rule: HostRule) -> bool:
    """A browser says the request comes from another origin (``Sec-Fetch-Site: cross-site``, the opaque ``null``
    origin, or an ``Origin`` that :meth:`HostRule.origin_allowed` refuses). Clients that send neither pass."""
    if head.headers.get("sec-fetch-site") == "cross-site":
        return True
    origin = head.headers.get("origin")
    if origin is None:
        return False
    return not rule.origin_allowed(origin, head.port, head.headers.get("host"), head.arrived_on)


def wants_page(head: RequestHead) -> bool:
    """A browser asking for an admin page (a GET that accepts HTML): sent to the login form, not a JSON 401."""
    return head.method == "GET" and head.path.startswith("/admin") and "text/html" in head.headers.get("accept", "")


def refusal(head: RequestHead, appliance: Appliance) -> ApplianceError | None:
    """Why the request is refused, or None to let it through (see the module docstring)."""
    path = head.path
    http = appliance.config.http
    rule = HostRule.of(http)
    host = head.headers.get("host")
    if not host_accepted(rule, host, head.arrived_on):
        return rule.refusal(host, head.arrived_on)
    if cors.is_preflight(head.method, head.headers):
        return None  # answered by the Guard (preflight_response): browsers send no credentials on one
    foreign = cross_origin(head, rule)
    token = http.api_token
    if token and path != LOGIN_PATH and not scrape_allowed(head.method, path, http.scrape_without_token) and \
            not authorized(head, token, appliance.session_secret, cookie_counts=not foreign):
        return ApplianceError("UNAUTHORIZED", "this appliance requires its API token: send "
                                              "'Authorization: Bearer <http.api_token>' or 'x-api-key: "
                                              "<http.api_token>' (or log in at /admin/login)",
                              {"path": shown_path(path)})
    if head.method not in UNSAFE_METHODS:
        return None
    origin = head.headers.get("origin")
    if foreign and not (origin is not None and cors.is_api(path) and cors_rule(appliance).allows(origin)):
        return ApplianceError("FORBIDDEN", "cross-origin request refused",
                              {"path": shown_path(path), "origin": shown(head.headers.get("origin", ""))})
    if path.startswith("/admin/") and path != LOGIN_PATH:
        given = head.headers.get(CSRF_HEADER, "")
        if not hmac.compare_digest(given.encode(), appliance.csrf_token.encode()):
            return ApplianceError("FORBIDDEN", "missing or wrong CSRF token (reload the admin page)",
                                  {"path": shown_path(path), "header": "X-CSRF-Token"})
    return None


def scrape_allowed(method: str, path: str, scrape_without_token: bool) -> bool:
    """``http.scrape_without_token`` lets this request through without the API token: a GET (or HEAD) of a
    :data:`SCRAPE_PATHS` path."""
    return scrape_without_token and method in SCRAPE_METHODS and path in SCRAPE_PATHS


def cors_rule(appliance: Appliance) -> cors.CorsRule:
    return cors.CorsRule(appliance.config.http.cors_origins)


def preflight_response(head: RequestHead, request: Request, appliance: Appliance) -> Response:
    """A CORS preflight's answer: 204 with its headers, or the P4 error that says why it is refused."""
    try:
        headers = cors_rule(appliance).preflight(head.path, head.headers["origin"],
                                                 head.headers["access-control-request-method"],
                                                 head.headers.get("access-control-request-headers", ""))
    except ApplianceError as error:
        refusals.log_refused(head.scope, error)
        return error_response(error, request)
    return Response(status_code=204, headers=dict(headers))


class Guard:
    """ASGI middleware: answer a refused request with its P4 error, a CORS preflight with its answer, pass the
    others on; an API response to a page of an allowed origin gets the CORS headers. A request it lets through
    costs no starlette ``Request``: its head is read from the scope once (:class:`RequestHead`)."""

    def __init__(self, app: ASGIApp, appliance: Appliance) -> None:
        self.app = app
        self.appliance = appliance

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = RequestHead(scope)
        error = refusal(head, self.appliance)
        if error is None and cors.is_preflight(head.method, head.headers):
            await preflight_response(head, Request(scope), self.appliance)(scope, receive, send)
            return
        if self.appliance.config.http.cors_origins:
            extra = cors.encoded(cors_rule(self.appliance).response_headers(head.path, head.headers.get("origin")))
            if extra:
                send = HeadersAdded(send, extra)
        if error is not None:
            request = Request(scope)
            response: Response = error_response(error, request)
            if error.code == "UNAUTHORIZED" and wants_page(head):
                response = RedirectResponse(LOGIN_PATH, status_code=303)
            refusals.log_refused(scope, error, response.status_code)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


class HeadersAdded:
    """``send`` that adds ``headers`` to the response's start."""

    __slots__ = ("send", "headers")

    def __init__(self, send: Send, headers: list[tuple[bytes, bytes]]) -> None:
        self.send = send
        self.headers = headers

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *self.headers]}
        await self.send(message)
