"""The HTTP surface's error mapping: every route's errors reach the client in the P4 shape, through one
exception handler, on a real uvicorn server."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import httpx
import pytest
from harness import running
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from appliance.errors import ApplianceError

P4_FIELDS = {"code", "message", "retryable", "details", "type", "param"}  # P4, with OpenAI's envelope fields


async def denied(request: Request) -> JSONResponse:
    raise ApplianceError("VRAM_LEDGER_DENY", "no room", {"requested_table_bytes": 7})


async def broken(request: Request) -> JSONResponse:
    raise RuntimeError("secret internals /etc/shadow")


@pytest.fixture
def http_url(tiny_model: Path):  # type: ignore[no-untyped-def]
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent]) as app:
        server = app.appliance.http_server
        assert server is not None
        server.config.app.router.routes.extend([Route("/test/denied", denied), Route("/test/broken", broken)])
        yield app.appliance.http_url


def test_an_appliance_error_from_any_route_is_its_p4_response(http_url: str) -> None:
    response = httpx.get(http_url + "/test/denied")
    assert response.status_code == 503
    error = response.json()["error"]
    assert set(error) == P4_FIELDS
    assert error["code"] == "VRAM_LEDGER_DENY" and error["retryable"] is True
    assert error["details"] == {"requested_table_bytes": 7}
    assert error["type"] == "server_error" and response.headers["retry-after"] == "1"


def test_an_unexpected_exception_is_internal_without_its_text(http_url: str) -> None:
    response = httpx.get(http_url + "/test/broken")
    assert response.status_code == 500
    error = response.json()["error"]
    assert set(error) == P4_FIELDS and error["code"] == "INTERNAL"
    assert "shadow" not in response.text and "RuntimeError" not in response.text
    assert httpx.get(http_url + "/v1/health").json()["status"] == "ok"  # still serving


def test_unknown_route_and_method_are_p4(http_url: str) -> None:
    missing = httpx.get(http_url + "/v1/nothing")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "NOT_FOUND"
    wrong = httpx.delete(http_url + "/v1/health")
    assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "METHOD_NOT_ALLOWED"


def test_http_connections_over_max_connections_get_a_p4_429_and_a_dribbled_head_times_out(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent], max_connections=1,
                 socket={"path": "a.sock", "request_timeout_s": 0.5}) as app:
        url = app.appliance.http_url
        assert url is not None
        with httpx.Client() as first:  # holds the only slot (kept alive)
            assert first.get(url + "/v1/health").status_code == 200
            refused = httpx.get(url + "/v1/health")
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"] == {"code": "TOO_MANY_CONNECTIONS", "retryable": True,
                                               "message": "the daemon serves at most 1 clients",
                                               "details": {"max_connections": 1},
                                               "type": "rate_limit_error", "param": None}
        host, port = url.removeprefix("http://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=10) as slow:
            slow.sendall(b"GET /v1/health HTTP/1.1\r\n")  # the head never ends
            start = time.monotonic()
            assert slow.recv(100) == b""  # closed by the request timeout
            assert 0.4 < time.monotonic() - start < 5


PAGE = "http://127.0.0.1:3000"


def test_an_unexpected_exception_keeps_the_cors_and_affinity_headers(tiny_model: Path) -> None:
    """starlette answers an unexpected exception from its outermost middleware, outside the Guard and the affinity
    headers: the INTERNAL reply still carries the headers an allowed origin's page needs to read it."""
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent],
                 http_settings={"cors_origins": [PAGE]}) as app:
        server = app.appliance.http_server
        assert server is not None
        server.config.app.router.routes.append(Route("/v1/test/broken", broken))
        url = app.appliance.http_url
        response = httpx.get(url + "/v1/test/broken", headers={"Origin": PAGE})
        assert response.status_code == 500 and response.json()["error"]["code"] == "INTERNAL"
        assert response.headers["access-control-allow-origin"] == PAGE
        assert "retry-after" in response.headers["access-control-expose-headers"]
        assert response.headers["vary"] == "Origin"
        assert response.headers["x-appliance-instance"] == httpx.get(url + "/v1/health").json()["instance"]
        other = httpx.get(url + "/v1/test/broken", headers={"Origin": "http://127.0.0.1:3001"})
        assert other.status_code == 500 and "access-control-allow-origin" not in other.headers
        assert other.headers["vary"] == "Origin"
        ok = httpx.get(url + "/v1/models", headers={"Origin": PAGE})  # the same headers as every other reply
        assert ok.headers["access-control-allow-origin"] == response.headers["access-control-allow-origin"]
        assert ok.headers["access-control-expose-headers"] == response.headers["access-control-expose-headers"]
