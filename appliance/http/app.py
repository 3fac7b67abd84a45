"""The HTTP surface (SPEC W1): a Starlette app over the same daemon core, plus its uvicorn server."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import TYPE_CHECKING

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from appliance.errors import ApplianceError, StartupError

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
    snapshot = daemon.snapshot() if daemon else {}
    return {"status": status, "models": models,
            "context_length": max((m["context_length"] for m in models), default=0),
            "agents": len(snapshot.get("agents", [])),
            "ledger": snapshot.get("ledger"), "socket": str(appliance.config.socket.path),
            "version": appliance.version}


def error_response(error: ApplianceError) -> JSONResponse:
    return JSONResponse({"error": error.to_dict()}, status_code=error.http_status)


async def appliance_error(request: Request, exc: Exception) -> JSONResponse:
    """Every :class:`ApplianceError` a route raises becomes its P4 response: one mapping for every route."""
    assert isinstance(exc, ApplianceError)
    return error_response(exc)


async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """Anything else is a bug: logged with its traceback, answered as P4 ``INTERNAL`` without its text."""
    log.error("HTTP %s %s failed", request.method, request.url.path, exc_info=exc)
    return error_response(ApplianceError("INTERNAL", "an unexpected internal error", {"path": request.url.path}))


async def not_found(request: Request, exc: Exception) -> JSONResponse:
    return error_response(ApplianceError("NOT_FOUND", f"no route {request.url.path}", {"path": request.url.path}))


async def method_not_allowed(request: Request, exc: Exception) -> JSONResponse:
    return error_response(ApplianceError("METHOD_NOT_ALLOWED", f"{request.method} is not allowed here",
                                         {"path": request.url.path, "method": request.method}))


EXCEPTION_HANDLERS = {
    404: not_found,
    405: method_not_allowed,
    ApplianceError: appliance_error,
    Exception: unexpected_error,
}


async def health(request: Request) -> JSONResponse:
    return JSONResponse(health_document(request.app.state.appliance))


def create_app(appliance: Appliance) -> Starlette:
    app = Starlette(routes=[Route("/v1/health", health)], exception_handlers=EXCEPTION_HANDLERS)
    app.state.appliance = appliance
    return app


class HttpServer(uvicorn.Server):
    """uvicorn on a socket we bind ourselves (so port 0 works and we know the port); the supervisor owns
    the signals, so uvicorn must not install its own handlers."""

    def __init__(self, app: Starlette, host: str, port: int) -> None:
        super().__init__(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.socket(family, socket.SOCK_STREAM)
        self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.socket.bind((host, port))
        except OSError as exc:
            self.socket.close()
            raise StartupError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
        self.socket.set_inheritable(True)
        self.host = host
        self.port = self.socket.getsockname()[1]

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def run_forever(self) -> None:
        await self.serve(sockets=[self.socket])

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"
