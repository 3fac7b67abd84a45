"""What the Guard reads of a request (appliance/http/security.py): the headers as starlette reads them (the first
of repeated ones, every Cookie header), the path the router matches, and the remembered Host decisions, which a
flood of distinct Host headers cannot grow."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from harness import running
from starlette.requests import Request

from appliance.http.security import HOST_DECISIONS, HeadHeaders, HostRule, RequestHead, host_accepted, shown_path


def scope_of(path: str, headers: list[tuple[bytes, bytes]]) -> dict:
    return {"type": "http", "method": "GET", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "scheme": "http", "headers": headers, "server": ("127.0.0.1", 8080),
            "client": ("127.0.0.1", 40000)}


HEADERS = [(b"host", b"127.0.0.1:8080"), (b"x-api-key", b"first"), (b"x-api-key", b"second"),
           (b"cookie", b"a=1; appliance_session=old"), (b"cookie", b"appliance_session=new"),
           (b"accept", b"text/html")]


def test_headers_read_as_starlette_reads_them() -> None:
    scope = scope_of("/v1/models", HEADERS)
    request = Request(scope)
    headers = HeadHeaders(HEADERS)
    for name in ("host", "x-api-key", "cookie", "accept", "origin"):
        assert headers.get(name) == request.headers.get(name), name
        assert (name in headers) == (name in request.headers), name
    assert headers["x-api-key"] == "first"
    with pytest.raises(KeyError):
        headers["origin"]  # noqa: B018
    assert sorted(headers) == sorted(set(request.headers.keys()))
    assert RequestHead(scope).cookie("appliance_session") == request.cookies["appliance_session"] == "new"
    assert RequestHead(scope).cookie("missing") is None


def test_the_path_is_the_one_the_router_matches_and_errors_show_it_as_before() -> None:
    scope = {**scope_of("/admin/x?y#z\\", HEADERS), "raw_path": b"/%61dmin/x%3Fy%23z%5C"}  # uvicorn unquotes
    head = RequestHead(scope)
    assert head.path == "/admin/x?y#z\\"
    assert shown_path(head.path) == Request(scope).url.path == "/admin/x%3Fy%23z%5C"
    assert (head.method, head.arrived_on, head.port) == ("GET", "127.0.0.1", 8080)


def test_host_decisions_are_remembered_within_a_bound() -> None:
    rule = HostRule("127.0.0.1", ("*.example.com",))
    host_accepted.cache_clear()
    assert host_accepted(rule, "localhost:8080", "127.0.0.1")
    assert host_accepted(rule, "localhost:8080", "127.0.0.1")
    assert host_accepted.cache_info().hits == 1
    assert not host_accepted(rule, "evil.test", "127.0.0.1")
    assert not host_accepted(rule, "bad host", "127.0.0.1")
    for index in range(HOST_DECISIONS * 2):  # a client that sends a new allowed name each time
        assert host_accepted(rule, f"n{index}.example.com", "127.0.0.1")
    assert host_accepted.cache_info().currsize == HOST_DECISIONS
    other = HostRule("127.0.0.1")  # a reloaded config is another rule: nothing carries over
    assert not host_accepted(other, "n1.example.com", "127.0.0.1")


def test_refusals_on_a_real_server(tiny_model: Path) -> None:
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent]) as app:
        url = app.appliance.http_url
        for path in ("/admin/anything", "/%61dmin/anything", "/admin%2Fanything", "/admin/x%3Fy"):
            response = httpx.post(url + path, headers={"Origin": url})
            assert response.status_code == 403, (path, response.text)
            error = response.json()["error"]
            assert "CSRF" in error["message"]
            assert error["details"]["path"] == path.replace("%61", "a").replace("%2F", "/")
        with httpx.Client(base_url=url) as client:
            for _ in range(3):
                assert client.get("/v1/models").status_code == 200
                refused = client.get("/v1/models", headers={"Host": "evil.example"})
                assert refused.status_code == 403 and refused.json()["error"]["code"] == "FORBIDDEN"
                malformed = client.get("/v1/models", headers={"Host": "bad host"})
                assert malformed.status_code == 400 and malformed.json()["error"]["code"] == "BAD_REQUEST"
