"""Hostile HTTP: DNS rebinding (a forged ``Host`` with a matching ``Origin``) against every state change, a login
brute force, an absurd chunk size, and the reason phrase of the connection cap's 429.

What was seen before the fix: a request with ``Host: evil.example:PORT`` and ``Origin: http://evil.example:PORT``
read the admin page (its CSRF token) and its POSTs registered agents, loaded models and ran chat completions; 50
wrong logins in 0.02 s were all checked; a chunk size line ``FFFFFFFFFFFFFFFF`` held its connection until the
request timeout; the connection cap's 429 had an empty reason phrase.
"""

from __future__ import annotations

import json
import math
import socket
import time
from pathlib import Path

import httpx
import pytest
from harness import running
from hostile_checks import HUNG_S

EVIL = "evil.example"


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def read_until_closed(sock: socket.socket, timeout: float) -> bytes:
    """Everything the appliance sends until it closes the connection (TimeoutError if it does not in time)."""
    sock.settimeout(timeout)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    return data


def raw_request(method: str, path: str, host: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in headers.items()),
             f"Content-Length: {len(body)}", "Connection: close", "", ""]
    return "\r\n".join(lines).encode() + body


def status_and_body(answer: bytes) -> tuple[int, bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


def p4_code(answer: bytes) -> str:
    return json.loads(status_and_body(answer)[1])["error"]["code"]


def test_a_rebound_name_reaches_no_route_over_raw_sockets(hostile):
    """The attacker's page at ``http://evil.example:PORT`` (rebound to 127.0.0.1) sends its own name as ``Host``
    and ``Origin`` and even knows the CSRF token: every read and every state change is refused with FORBIDDEN."""
    url = hostile.http
    port = port_of(url)
    forged = f"{EVIL}:{port}"
    csrf = hostile.app.appliance.csrf_token
    config_before = hostile.app.appliance.config
    same_origin = {"Origin": f"http://{forged}", "Sec-Fetch-Site": "same-origin", "X-CSRF-Token": csrf,
                   "Content-Type": "application/x-www-form-urlencoded"}
    chat = json.dumps({"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).encode()
    cases = [("GET", "/admin/", b""), ("GET", "/v1/models", b""), ("GET", "/metrics", b""),
             ("POST", "/admin/registry/register", b"agent=rebound&model=demo"),
             ("POST", "/admin/registry/load", b"model=demo-b"), ("POST", "/admin/config/reload", b""),
             ("POST", "/admin/benchmarks/run", b"model=demo"), ("POST", "/admin/device/resync", b""),
             ("POST", "/v1/chat/completions", chat)]
    for method, path, body in cases:
        with socket.create_connection(("127.0.0.1", port), timeout=HUNG_S) as sock:
            sock.sendall(raw_request(method, path, forged, same_origin, body))
            status, body = status_and_body(read_until_closed(sock, HUNG_S))
        assert status == 403, (method, path, status, body[:200])
        document = json.loads(body)
        assert document["error"]["code"] == "FORBIDDEN" and document["error"]["details"] == {"host": EVIL}
    daemon = hostile.app.daemon
    assert "rebound" not in daemon.agents
    assert daemon.model_state("demo-b") != "loaded"
    assert not any(record.surface == "openai" for record in daemon.requests.recent(200))
    assert hostile.app.appliance.benchmark_job.state == "idle" and hostile.app.appliance.benchmark_job.argv == []
    assert hostile.app.appliance.config is config_before  # no reload ran


def test_a_rebound_name_is_refused_to_httpx_and_the_real_name_still_works(hostile):
    url = hostile.http
    port = port_of(url)
    forged = {"Host": f"{EVIL}:{port}", "Origin": f"http://{EVIL}:{port}"}
    for _ in range(200):  # a burst: each refusal is cheap and the neighbour goes on
        refused = httpx.get(url + "/v1/health", headers=forged, timeout=HUNG_S)
        assert refused.status_code == 403
    csrf = {"Origin": url, "X-CSRF-Token": hostile.app.appliance.csrf_token}
    registered = httpx.post(url + "/admin/registry/register", data={"agent": "legit", "model": "demo"}, headers=csrf,
                            timeout=HUNG_S)
    assert registered.status_code == 200 and registered.headers["x-appliance-outcome"] == "ok"
    assert "legit" in hostile.app.daemon.agents
    gone = httpx.post(url + "/admin/registry/unregister", data={"agent": "legit"}, headers=csrf, timeout=HUNG_S)
    assert gone.headers["x-appliance-outcome"] == "ok"


def test_an_absurd_chunk_size_is_refused_at_once_without_reading_the_body(hostile):
    """``FFFFFFFFFFFFFFFF`` (h11 takes up to 20 hex digits and would wait for that many bytes) gets a P4 400 and a
    closed connection at once, not after the request timeout (10 s)."""
    port = port_of(hostile.http)
    head = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    for size_line in (b"FFFFFFFFFFFFFFFF\r\n", b"400001\r\n", b"FFFFFFFFFFFFFFFFFFFF;ext=1\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=HUNG_S) as sock:
            start = time.monotonic()
            sock.sendall(head + size_line + b'{"model":')
            answer = read_until_closed(sock, 5)
            elapsed = time.monotonic() - start
        assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer[:200]
        error = json.loads(status_and_body(answer)[1])["error"]
        assert error["code"] == "BAD_REQUEST" and "chunk" in error["message"]
        assert elapsed < 3, elapsed
    # a chunk the size of the largest body is still read (and refused by the route as too large only past it)
    with socket.create_connection(("127.0.0.1", port), timeout=HUNG_S) as sock:
        body = json.dumps({"model": "demo", "prompt": "hi", "max_tokens": 1}).encode()
        sock.sendall(head.replace(b"chat/completions", b"completions") + f"{len(body):x}\r\n".encode() + body
                     + b"\r\n0\r\n\r\n")
        answer = sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer[:200]


def test_a_malformed_request_gets_a_p4_bad_request(hostile):
    port = port_of(hostile.http)
    for request in (b"GET /v1/health HTTP/1.1\r\n\r\n",  # no Host on HTTP/1.1
                    b"GET /v1/health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"):
        with socket.create_connection(("127.0.0.1", port), timeout=HUNG_S) as sock:
            sock.sendall(request)
            answer = read_until_closed(sock, 5)
        assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n"), answer[:200]
        assert p4_code(answer) == "BAD_REQUEST"


@pytest.mark.hostile_config(max_connections=3)
def test_the_connection_caps_429_carries_its_reason_phrase(hostile):
    """The neighbour and the prober hold 2 of the 3 slots; one more HTTP connection fills it; the next one gets the
    P4 429 with the standard reason phrase."""
    port = port_of(hostile.http)
    with socket.create_connection(("127.0.0.1", port), timeout=HUNG_S) as holder:
        holder.sendall(b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert holder.recv(65536).startswith(b"HTTP/1.1 200 OK\r\n")
        with socket.create_connection(("127.0.0.1", port), timeout=HUNG_S) as extra:
            extra.sendall(b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            answer = read_until_closed(extra, HUNG_S)
    assert answer.startswith(b"HTTP/1.1 429 Too Many Requests\r\n"), answer[:100]
    assert p4_code(answer) == "TOO_MANY_CONNECTIONS"


def test_a_login_brute_force_is_throttled_and_the_appliance_serves_on(record_case, tiny_model: Path):
    """200 wrong logins as fast as they go, from one address: 6 are checked, then the rest are refused with
    Retry-After and never compared (but for one more each time a delay of 1, 2, 4 ... s ran out meanwhile); the
    appliance answers throughout and the right token works once the delay is over."""
    token = "brute-force-target"
    with running({"demo": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent],
                 http_settings={"host": "127.0.0.1", "port": 0, "api_token": token}) as app:
        url = app.appliance.http_url
        checked = 0
        start = time.monotonic()
        with httpx.Client(base_url=url, timeout=HUNG_S) as attacker:
            for i in range(200):
                answer = attacker.post("/admin/login", data={"token": f"guess-{i}"}, headers={"Origin": url})
                assert answer.status_code == 401
                checked += "retry-after" not in answer.headers
            health = attacker.get("/v1/health", headers={"Authorization": f"Bearer {token}"})
        hung = time.monotonic() - start > HUNG_S
        record_case(crashed=health.status_code != 200, hung=hung)
        assert health.status_code == 200 and not hung
        assert 6 <= checked <= 6 + math.log2(1 + time.monotonic() - start), checked
        deadline = time.monotonic() + 10
        accepted = httpx.post(url + "/admin/login", data={"token": token}, headers={"Origin": url})
        while accepted.status_code != 303 and time.monotonic() < deadline:
            time.sleep(0.2)
            accepted = httpx.post(url + "/admin/login", data={"token": token}, headers={"Origin": url})
        assert accepted.status_code == 303
