"""The access-log line of an HTTP request refused before it ran (:func:`appliance.daemon.accesslog.refusal_line`).

A request that reached the daemon (a generation's run, an embeddings request) is one record of the request log,
whose observer writes its line; every other error reply is a refusal: the guard's, the router's (no route, a method
the route does not take), a route's before it handed the request over (a body too large or malformed, a model
that is not there), and the connection's (``max_connections``, a request that is not HTTP/1.1). Each writes one
line with :func:`log_refused`, from the request's ASGI scope: its method, its path (never its query, its headers,
its token or its body) and its client's address.
"""

from __future__ import annotations

from typing import Any

from starlette.types import Scope

from appliance.daemon import accesslog
from appliance.errors import ApplianceError
from appliance.http.affinity import RUN_STATE

LOGGED_STATE = "appliance_logged"
"""The key of a request's ASGI ``state`` that says its access line is written elsewhere: it reached the daemon, whose
request log writes it, or its connection refused it (:func:`note_logged`)."""


def note_logged(scope: Scope) -> None:
    """The request of ``scope`` has its access line elsewhere from now on: it was handed to the daemon (the request
    log's record is its line, whatever its end), or its connection refused it."""
    scope.setdefault("state", {})[LOGGED_STATE] = True


def recorded(scope: Scope) -> bool:
    """The request's line is written elsewhere (:func:`note_logged`, or a generation's run was noted)."""
    state: dict[str, Any] = scope.get("state") or {}
    return LOGGED_STATE in state or RUN_STATE in state


def client_of(scope: Scope) -> str | None:
    client = scope.get("client")
    return None if not client else str(client[0])


def log_refused(scope: Scope, error: ApplianceError, status: int | None = None) -> None:
    """The access line of the request of ``scope``, refused with ``error`` (``status``: the one sent, when it is
    not the error's own)."""
    accesslog.log_refusal(scope.get("method"), scope.get("path"), status or error.http_status, error,
                          client_of(scope))


def log_unrecorded(scope: Scope, error: ApplianceError) -> None:
    """:func:`log_refused`, unless the request reached the daemon (its record has its line)."""
    if not recorded(scope):
        log_refused(scope, error)
