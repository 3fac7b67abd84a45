"""The HTTP surface's error mapping: every route's errors reach the client in the P4 shape, through one
exception handler, on a real uvicorn server."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from harness import running
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from appliance.errors import ApplianceError

P4_FIELDS = {"code", "message", "retryable", "details"}


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
    assert response.status_code == 507
    error = response.json()["error"]
    assert set(error) == P4_FIELDS
    assert error["code"] == "VRAM_LEDGER_DENY" and error["retryable"] is True
    assert error["details"] == {"requested_table_bytes": 7}


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
