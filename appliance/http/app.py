"""The HTTP surface (SPEC W1): a Starlette app over the same daemon core, plus its uvicorn server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import time
from collections.abc import Iterator
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import h11
import uvicorn
from h11._readers import ChunkedReader
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import Scope
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from appliance.daemon import accesslog
from appliance.daemon.durable import RESTORED_FROM
from appliance.errors import ApplianceError, StartupError
from appliance.http import cors, refusals, requestcounts
from appliance.http.affinity import RUN_STATE, AffinityHeaders, appliance_instance
from appliance.http.affinity import response_headers as affinity_headers
from appliance.http.assets import web_dir
from appliance.http.chunkwrite import SCOPE_KEY, ChunkWriter
from appliance.http.errors import RETRY_AFTER_S, error_body, error_response
from appliance.http.headwrite import HeldHeadTransport, Wire
from appliance.http.lazyroutes import LazyRoutes
from appliance.http.loginthrottle import LoginThrottle
from appliance.http.openai_schema import MAX_BODY_BYTES
from appliance.http.security import Guard, RequestHead, cors_rule, shown
from appliance.protocol import paging

if TYPE_CHECKING:
    from appliance.app import Appliance

log = logging.getLogger(__name__)


def health_document(appliance: Appliance) -> dict:
    """``/v1/health`` from memory: never waits on a model or the engine thread."""
    daemon = appliance.daemon
    models = [{"name": spec.name, "state": daemon.model_state(spec.name) if daemon else "available",
               "context_length": spec.n_ctx} for spec in appliance.config.models]
    status = "ok"
    if daemon is None:
        status = "degraded"
    elif any(m["state"] == "loading" for m in models):
        status = "loading"
    config = appliance.config_report()
    reasons: list[str] = []
    problem: dict[str, Any] = {}
    if config["status"] == "invalid":  # the file on disk: the appliance goes on with its last valid config
        reasons.append(f"{config['file']} is invalid: {config['path'] or 'file'}: {config['reason']}")
        problem["line"] = config["line"]
    state_files = [found.to_dict() for found in appliance.state_files.problems()]  # retried until written
    reasons.extend(found["reason"] for found in state_files)
    durability = daemon.durability() if daemon else {}  # the agents' store and the disk tier of KV state
    reasons.extend(report["reason"] for report in durability.values() if report["status"] == "degraded")
    missing = daemon.missing_models() if daemon else []  # configured, their file not there: the rest serves
    reasons.extend(found.reason for found in missing)
    notices = []
    moved_aside = durability.get("store", {}).get("moved_aside")
    if moved_aside is not None:
        notices.append(f"the agents store failed its integrity check at start: moved aside to {moved_aside}; its "
                       "agents were not restored")
    if reasons:
        status = "degraded"
        problem = {"reason": "; ".join(reasons), **problem}
    snapshot = daemon.snapshot() if daemon else {}
    parked = [{"id": a["id"], "model": a["model"], "bytes": a["state_bytes"]}
              for a in snapshot.get("agents", []) if a["state"] == "host"]
    restored = {where: snapshot["counters"][f"restored_from_{where}"] for where in RESTORED_FROM} if daemon else {}
    return {"status": status, **problem, "notices": notices, "config": config, "state_files": state_files,
            **durability, "kv_restored_from": restored, "models": models,
            "missing_models": [found.to_dict() for found in missing],
            "context_length": max((m["context_length"] for m in models), default=0),
            "agents": len(snapshot.get("agents", [])),
            "ledger": snapshot.get("ledger"), "host_kv": snapshot.get("host_kv"),
            "warming": sorted(daemon.adaptive.warming) if daemon else [],  # models whose warm-up runs now (E5)
            "engine": snapshot.get("engine"), "contexts": snapshot.get("contexts", []),
            "parked_agents": parked[:paging.HEALTH_PARKED_AGENTS],  # the first ones: STATUS agents pages them all
            "parked_agents_total": len(parked),
            "socket": str(appliance.config.socket.path),
            "instance": appliance_instance(appliance),  # also its x-appliance-instance header (a fleet's router)
            "version": appliance.version}


async def appliance_error(request: Request, exc: Exception) -> JSONResponse:
    """Every :class:`ApplianceError` a route raises becomes its P4 response: one mapping for every route. One
    raised before the request reached the daemon is a refusal, with its access line."""
    assert isinstance(exc, ApplianceError)
    refusals.log_unrecorded(request.scope, exc)
    return error_response(exc, request)


async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """Anything else is a bug: logged with its traceback, answered as P4 ``INTERNAL`` without its text. The
    reply comes from starlette's outermost middleware, outside the Guard and :class:`AffinityHeaders`: it gets
    their headers here (a browser page of an allowed origin reads the error, not a CORS failure)."""
    log.error("HTTP %s %s failed", request.method, request.url.path, exc_info=exc)
    response = error_response(ApplianceError("INTERNAL", "an unexpected internal error",
                                             {"path": request.url.path}), request)
    for name, value in outer_headers(request.app.state.appliance, request.scope):
        response.headers.append(name, value)
    return response


def outer_headers(appliance: Appliance, scope: Scope) -> list[tuple[str, str]]:
    """The headers the Guard (CORS) and :class:`AffinityHeaders` add to a response to the request of ``scope``."""
    path = scope["path"]
    origin = RequestHead(scope).headers.get("origin")
    headers = cors_rule(appliance).response_headers(path, origin) if appliance.config.http.cors_origins else []
    if cors.is_api(path):
        run = (scope.get("state") or {}).get(RUN_STATE)
        headers += affinity_headers(appliance_instance(appliance), None if run is None else run.agent_id)
    return headers


async def client_disconnected(request: Request, exc: Exception) -> JSONResponse:
    """The client went away before its request body arrived whole (an aborted upload, a broken chunked body): its
    failure, not the daemon's, so ``BAD_REQUEST`` (sent to nobody), never a logged ``INTERNAL``."""
    error = ApplianceError("BAD_REQUEST", "the client disconnected before its request body arrived",
                           {"path": request.url.path})
    refusals.log_unrecorded(request.scope, error)
    return error_response(error, request)


async def not_found(request: Request, exc: Exception) -> JSONResponse:
    error = ApplianceError("NOT_FOUND", f"no route {request.url.path}", {"path": request.url.path})
    refusals.log_refused(request.scope, error)
    return error_response(error, request)


async def method_not_allowed(request: Request, exc: Exception) -> JSONResponse:
    error = ApplianceError("METHOD_NOT_ALLOWED", f"{request.method} is not allowed here",
                           {"path": request.url.path, "method": request.method})
    refusals.log_refused(request.scope, error)
    return error_response(error, request)


EXCEPTION_HANDLERS = {
    404: not_found,
    405: method_not_allowed,
    ApplianceError: appliance_error,
    ClientDisconnect: client_disconnected,
    Exception: unexpected_error,
}


async def health(request: Request) -> JSONResponse:
    return JSONResponse(health_document(request.app.state.appliance))


def admin_routes() -> list[BaseRoute]:
    from appliance.http import admin

    return admin.routes


def anthropic_routes() -> list[BaseRoute]:
    from appliance.http import anthropic

    return anthropic.routes


def embedding_routes() -> list[BaseRoute]:
    from appliance.http import embeddings

    return embeddings.routes


def response_routes() -> list[BaseRoute]:
    from appliance.http import responses

    return responses.routes


def metrics_routes() -> list[BaseRoute]:
    from appliance.http import metrics

    return metrics.routes


def create_app(appliance: Appliance) -> Starlette:
    """The HTTP app: health, the OpenAI-compatible API, metrics, the admin page and its static files, behind the
    :class:`~appliance.http.security.Guard` (host allow-list, API token, cross-origin and CSRF checks). The route
    families a request may never use are imported at their first request (:class:`LazyRoutes`), in their place."""
    from appliance.http import openai

    routes = [Route("/v1/health", health), Route("/health", health),  # /health: the alias probes expect
              *openai.routes,
              LazyRoutes(anthropic_routes, paths=["/v1/messages"], prefixes=["/v1/messages/"]),
              LazyRoutes(embedding_routes, paths=["/v1/embeddings"]),
              LazyRoutes(response_routes, paths=["/v1/responses"], prefixes=["/v1/responses/"]),
              LazyRoutes(metrics_routes, paths=["/metrics"]),
              LazyRoutes(admin_routes, paths=["/", "/admin"], prefixes=["/admin/"]),
              Mount("/static", StaticFiles(directory=web_dir()), name="static")]
    middleware = [Middleware(Guard, appliance=appliance), Middleware(AffinityHeaders, appliance=appliance)]
    app = Starlette(routes=routes, exception_handlers=EXCEPTION_HANDLERS, middleware=middleware)
    app.state.appliance = appliance
    app.state.login_throttle = LoginThrottle(time.monotonic)  # wrong admin logins, for this app's lifetime
    requestcounts.attach(appliance)  # request metrics from the start, not from the first scrape
    return app


CLOSE_GRACE_S = 2.0
"""How long a stopping server waits for HTTP requests in progress."""


class BodyLimitedConnection(h11.Connection):
    """h11's server side of a connection, refusing a body chunk larger than ``max_chunk_bytes`` as soon as its size
    line is parsed (h11 takes up to 20 hex digits and would wait for that many bytes), and keeping why it refused a
    request (:attr:`refusal`) for :meth:`GuardedH11Protocol.send_400_response`."""

    def __init__(self, max_chunk_bytes: int, max_incomplete_event_size: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size)
        self.max_chunk_bytes = max_chunk_bytes
        self.refusal: ApplianceError | None = None

    def next_event(self) -> Any:
        try:
            event = super().next_event()
        except h11.RemoteProtocolError as exc:
            self.refusal = ApplianceError("BAD_REQUEST", "the request is not valid HTTP/1.1",
                                          {"reason": shown(str(exc))})
            raise
        declared = self.chunk_bytes_owed()
        if isinstance(event, h11.Data) and event.chunk_start:
            declared += len(event.data)  # the chunk's size, of which this much came with its size line
        if declared > self.max_chunk_bytes:
            self.refusal = ApplianceError(
                "BAD_REQUEST", f"a request body chunk of {declared} bytes is larger than the largest body accepted "
                               f"({self.max_chunk_bytes} bytes)",
                {"chunk_bytes": declared, "max_body_bytes": self.max_chunk_bytes})
            raise h11.RemoteProtocolError(self.refusal.message)
        return event

    def chunk_bytes_owed(self) -> int:
        """The bytes h11's chunked reader still expects of the current chunk; 0 when no chunked body is being read.
        h11 has no public accessor for it."""
        reader = self._reader
        if isinstance(reader, ChunkedReader):
            return reader._bytes_in_chunk
        return 0


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 connection with the appliance's limits (one instance per HTTP connection):

    * ``max_connections`` counts HTTP and socket connections together: one over it gets a P4
      ``TOO_MANY_CONNECTIONS`` (429) once its request head arrived, and is closed; it is not counted meanwhile;
    * a request once started (and a connection's first one, from its accept) must arrive whole within
      ``socket.request_timeout_s`` (uvicorn has no header timeout: a slow-dribbling client would hold its slot);
    * a request h11 cannot parse, or with a body chunk larger than the largest body accepted
      (:data:`~appliance.http.openai_schema.MAX_BODY_BYTES`), gets a P4 ``BAD_REQUEST`` at once, its body unread;
    * an idle keep-alive connection closes after ``http.keep_alive_timeout_s`` (uvicorn's timer, set per
      connection from the current config);
    * a response's head leaves with the first write that follows it in the same event-loop step
      (:class:`~appliance.http.headwrite.HeldHeadTransport`): a small response is one socket write;
    * a streamed body's chunks may be written past the middlewares and h11 (:class:`~appliance.http.chunkwrite.
      ChunkWriter`, in the request's scope), from the loop or from the engine thread (every write of the
      connection's holds its :class:`~appliance.http.headwrite.Wire`'s lock; the wire is closed before the socket).
    """

    def __init__(self, config: uvicorn.Config, server_state: ServerState, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.conn = BodyLimitedConnection(MAX_BODY_BYTES, self.conn._max_incomplete_event_size)
        self.appliance: Appliance = config.app.state.appliance  # type: ignore[attr-defined]
        self.timeout_keep_alive = self.appliance.config.http.keep_alive_timeout_s
        self.refused = False
        self.wire = Wire(None)  # the socket's, once connected
        self._request_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.wire = Wire.of(transport)
        limit = self.appliance.config.max_connections
        if self.appliance.open_connections() > limit:  # this one included
            self.refused = True
            self.connections.discard(self)  # a refused connection holds no slot
        elif self.appliance.daemon is not None:
            self.appliance.daemon.connections["http"] += 1  # accepted connections by protocol (metrics)
        self._arm_request_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self.wire.close()  # before asyncio closes the socket: no thread writes to it any more
        self._disarm_request_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            self._refuse(data)
            return
        super().data_received(data)
        if self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            if self._request_timer is None:
                self._arm_request_timer()  # the first bytes of the next request
        else:
            self._disarm_request_timer()

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not None and self.cycle is not cycle:  # a request began: its response gets one write
            self.cycle.transport = HeldHeadTransport(self.transport, self.loop, self.wire)  # type: ignore[assignment]
            extensions = self.cycle.scope.setdefault("extensions", {})  # type: ignore[typeddict-item]
            extensions[SCOPE_KEY] = ChunkWriter(self.cycle)  # its stream's chunks skip the middlewares and h11

    def _refuse(self, data: bytes) -> None:
        """Read the refused connection's request head, answer 503 TOO_MANY_CONNECTIONS and close."""
        self.conn.receive_data(data)
        try:
            event = self.conn.next_event()
        except h11.RemoteProtocolError:
            self.transport.close()
            return
        if not isinstance(event, h11.Request):
            return  # the head is not in yet
        limit = self.appliance.config.max_connections
        self._answer_and_close(ApplianceError("TOO_MANY_CONNECTIONS", f"the daemon serves at most {limit} clients",
                                              {"max_connections": limit}), event)

    def send_400_response(self, msg: str) -> None:
        """A request h11 cannot parse (uvicorn's own answer is plain text) gets the P4 ``BAD_REQUEST``, then the
        close; one refused mid-body (:class:`BodyLimitedConnection`) too, and its route, if it runs, sees its client
        gone (it may send nothing more)."""
        assert isinstance(self.conn, BodyLimitedConnection)
        if self.cycle is not None and not self.cycle.response_complete:
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self._answer_and_close(self.conn.refusal or ApplianceError("BAD_REQUEST", "the request is not valid HTTP/1.1"))

    def _answer_and_close(self, error: ApplianceError, head: h11.Request | None = None) -> None:
        """Answer ``error`` as its P4 JSON response outside any ASGI request (its access line from ``head``, the
        request's, or the request cycle's, when read), and close the connection."""
        self._log_refusal(error, head)
        body = json.dumps(error_body(error)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        if error.retryable and error.http_status in (429, 503):
            headers.append((b"retry-after", str(RETRY_AFTER_S).encode()))
        if self.conn.our_state in (h11.IDLE, h11.SEND_RESPONSE):  # else a response has started: just close
            reason = HTTPStatus(error.http_status).phrase.encode()  # h11 would send none
            self.transport.write(self.conn.send(h11.Response(status_code=error.http_status, headers=headers,
                                                             reason=reason)))
            self.transport.write(self.conn.send(h11.Data(data=body)))
            self.transport.write(self.conn.send(h11.EndOfMessage()))
        self.transport.close()

    def _log_refusal(self, error: ApplianceError, head: h11.Request | None) -> None:
        method = path = None
        if head is not None:
            method = head.method.decode("latin-1")
            path = head.target.decode("latin-1").partition("?")[0]
        elif self.cycle is not None and not self.cycle.response_complete:  # refused mid-body
            method, path = self.cycle.scope["method"], self.cycle.scope["path"]
            refusals.note_logged(self.cycle.scope)  # type: ignore[arg-type]  # its route writes no line of its own
        client = self.client[0] if self.client else None
        accesslog.log_refusal(method, path, error.http_status, error, client)

    def _arm_request_timer(self) -> None:
        self._disarm_request_timer()
        timeout = self.appliance.config.socket.request_timeout_s
        self._request_timer = self.loop.call_later(timeout, self._request_timeout)

    def _disarm_request_timer(self) -> None:
        if self._request_timer is not None:
            self._request_timer.cancel()
            self._request_timer = None

    def _request_timeout(self) -> None:
        self._request_timer = None
        if self.refused or self.conn.their_state in (h11.IDLE, h11.SEND_BODY):
            self.transport.close()  # the request did not arrive whole in time


class HttpServer(uvicorn.Server):
    """uvicorn on a socket we bind ourselves (so port 0 works and we know the port); the supervisor owns
    the signals, so uvicorn must not install its own handlers. Its connections are :class:`GuardedH11Protocol`
    s, counted with the socket's against ``max_connections``."""

    def __init__(self, app: Starlette, host: str, port: int) -> None:
        appliance = app.state.appliance
        super().__init__(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False,
                                        http=GuardedH11Protocol,  # it limits connections (reload-aware)
                                        timeout_keep_alive=int(appliance.config.http.keep_alive_timeout_s),
                                        timeout_graceful_shutdown=int(CLOSE_GRACE_S)))
        self.appliance = appliance
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP, not 0: accepted sockets inherit it, and asyncio sets TCP_NODELAY only on sockets that say TCP
        # (without it every small response waits out the client's delayed ACK: about 40 ms per request)
        self.socket = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError as exc:
            self.socket.close()
            raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        self.socket.set_inheritable(True)
        self.host = host
        self.port = self.socket.getsockname()[1]

    def open_connections(self) -> int:
        """HTTP connections holding a slot now."""
        return len(self.server_state.connections)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def run_forever(self) -> None:
        await self.serve(sockets=[self.socket])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"
