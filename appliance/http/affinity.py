"""What a router in front of several appliances needs to keep an agent on its box: response headers.

* ``x-appliance-instance: <name>`` on every response of the API (``/v1/…``, ``/health``): generation replies of
  every surface, plain or streamed, their errors, ``/v1/health`` and ``/v1/models`` (a router can probe a box for
  its name). The name is ``http.instance_name``, or ``<host name>:<HTTP port>`` when that is null.
* ``x-appliance-agent: <agent id>`` on a generation reply whose request ran in an agent: the id it is keyed under
  (``X-Agent-Id``; OpenAI's ``user`` and Anthropic's ``metadata.user_id`` as ``<user>@<model>``; the Responses
  API's conversation, named by its first response's id). Absent for a stateless request.

:class:`AffinityHeaders` is the ASGI middleware that adds them (inside the :class:`~appliance.http.security.Guard`,
so a refused request gets neither); a generation route names its run with :func:`note_run`.
"""

from __future__ import annotations

import functools
import socket
from typing import TYPE_CHECKING, Protocol

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from appliance.http import cors

if TYPE_CHECKING:
    from appliance.app import Appliance

INSTANCE_HEADER = "x-appliance-instance"
AGENT_HEADER = "x-appliance-agent"
RUN_STATE = "appliance_run"
"""The key of a request's ASGI ``state`` under which its generation run is noted."""


class KeyedRun(Protocol):
    """A generation run: ``agent_id`` is the agent it runs in once it started (None: stateless)."""

    agent_id: str | None


@functools.cache
def host_name() -> str:
    """This machine's host name, read once."""
    return socket.gethostname()


def instance_name(configured: str | None, host: str, port: int) -> str:
    """``http.instance_name``, or ``<host>:<port>`` when it is null."""
    if configured is not None:
        return configured
    return f"{host}:{port}"


def appliance_instance(appliance: Appliance) -> str:
    """The appliance's instance name now (the port the HTTP server listens on: a reload may rebind it)."""
    http = appliance.config.http
    server = appliance.http_server
    port = server.port if server is not None else http.port
    return instance_name(http.instance_name, host_name(), port)


def instance_report(appliance: Appliance) -> dict[str, str]:
    """STATUS's ``instance`` record."""
    return {"name": appliance_instance(appliance)}


def response_headers(instance: str, agent_id: str | None) -> list[tuple[str, str]]:
    """The affinity headers of one API response."""
    headers = [(INSTANCE_HEADER, instance)]
    if agent_id is not None:
        headers.append((AGENT_HEADER, agent_id))
    return headers


def note_run(request: Request, run: KeyedRun) -> None:
    """Name ``run`` as ``request``'s generation: its agent is read when the response starts."""
    request.state.appliance_run = run


class AffinityHeaders:
    """ASGI middleware: the affinity headers on every API response (module docstring)."""

    def __init__(self, app: ASGIApp, appliance: Appliance) -> None:
        self.app = app
        self.appliance = appliance

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not cors.is_api(scope["path"]):
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})  # the route's request.state writes into this same dict

        async def sender(message: Message) -> None:
            if message["type"] == "http.response.start":
                run: KeyedRun | None = state.get(RUN_STATE)
                agent_id = None if run is None else run.agent_id
                extra = cors.encoded(response_headers(appliance_instance(self.appliance), agent_id))
                message = {**message, "headers": [*message.get("headers", []), *extra]}
            await send(message)

        await self.app(scope, receive, sender)
