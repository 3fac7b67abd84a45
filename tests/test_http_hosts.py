"""HTTP hardening: the ``Host`` allow-list (DNS rebinding), the cross-origin check that no longer trusts ``Host``,
the login page (headers, throttle, Secure cookie, logout) and h11's chunk sizes; the pure parts alone, then
against a real appliance."""

from __future__ import annotations

import math
import socket
import time
from pathlib import Path

import h11
import httpx
import pytest
from harness import running

from appliance.http.app import BodyLimitedConnection
from appliance.http.loginthrottle import LoginThrottle
from appliance.http.security import Authority, HostRule, is_loopback, parse_authority

TOKEN = "s3cret-token-for-hosts"
EVIL = "evil.example"
READS = ("/v1/health", "/metrics", "/admin/", "/v1/models", "/static/admin.css", "/no/such/route")


# -- the pure parts ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("127.0.0.1", Authority("127.0.0.1", None)), ("127.0.0.1:8080", Authority("127.0.0.1", 8080)),
    ("LocalHost.:80", Authority("localhost", 80)), ("[::1]", Authority("[::1]", None)),
    ("[::1]:0", Authority("[::1]", 0)), ("box.lan:65535", Authority("box.lan", 65535)),
    ("", None), ("::1", None), ("[::1", None), ("[nope]:80", None), ("a:b", None), ("a:65536", None),
    ("a:", None), ("a:-1", None), ("a b", None), ("a/b", None), ("u@a", None), ("a..b", None), ("*.a", None),
    ("[::1]x", None), ("a" * 254, None),
])
def test_parse_authority(text: str, expected: Authority | None) -> None:
    assert parse_authority(text) == expected


def test_loopback_names_and_addresses() -> None:
    for name in ("localhost", "LOCALHOST", "a.localhost", "127.0.0.1", "127.255.0.9", "[::1]", "::1",
                 "[::ffff:127.0.0.1]"):
        assert is_loopback(name), name
    for name in ("localhost.evil", "evillocalhost", "10.0.0.1", "[::2]", "0.0.0.0", "128.0.0.1"):
        assert not is_loopback(name), name


def test_the_host_rule() -> None:
    rule = HostRule("192.0.2.7", ("box.lan", "*.example.com", "[2001:db8::1]", "198.51.100.1"))
    for name in ("localhost", "127.0.0.5", "[::1]", "192.0.2.7", "box.lan", "a.example.com", "b.a.example.com",
                 "[2001:db8:0::1]", "198.51.100.1"):
        assert rule.allows(name), name
    for name in ("example.com", "xexample.com", "box.lan.evil", "192.0.2.8", "[2001:db8::2]", "evil.example"):
        assert not rule.allows(name), name
    assert HostRule("box.lan").allows("box.lan") and not HostRule("box.lan").allows("evil.lan")
    assert HostRule("127.0.0.1", ("*",)).allows("anything.at.all")


def test_an_any_address_bind_answers_to_the_address_a_request_arrived_on_only() -> None:
    rule = HostRule("0.0.0.0")
    assert rule.allows("192.0.2.7", arrived_on="192.0.2.7")
    assert rule.allows("192.0.2.7", arrived_on="::ffff:192.0.2.7")  # a dual-stack socket's IPv4 peer
    assert not rule.allows("192.0.2.8", arrived_on="192.0.2.7")
    assert rule.allows("0.0.0.0")  # http.host itself: the URL the appliance advertises (the registry, its log)
    assert not rule.allows("box.lan", arrived_on="192.0.2.7")
    error = rule.refusal("box.lan:8080", "192.0.2.7")
    assert error is not None and error.code == "FORBIDDEN" and error.details == {"host": "box.lan"}
    assert "http.allowed_hosts" in error.message and "0.0.0.0" in error.message


def test_host_refusals() -> None:
    rule = HostRule("127.0.0.1")
    assert rule.refusal(None, "127.0.0.1") is None  # HTTP/1.0 without Host: addressed to where it arrived
    assert rule.refusal("localhost:1234", "127.0.0.1") is None  # the port is not compared
    forbidden = rule.refusal("EVIL.example.:80", "127.0.0.1")
    assert forbidden is not None and forbidden.code == "FORBIDDEN" and forbidden.details == {"host": "evil.example"}
    bad = rule.refusal("x" * 500 + ":80", "127.0.0.1")
    assert bad is not None and bad.code == "BAD_REQUEST" and len(bad.details["host"]) == 64


def test_an_origin_must_name_an_allowed_host_on_this_servers_port() -> None:
    rule = HostRule("127.0.0.1", ("box.lan",))
    for origin in ("http://127.0.0.1:8080", "http://localhost:8080", "http://[::1]:8080", "https://box.lan:8080"):
        assert rule.origin_allowed(origin, 8080, "127.0.0.1:8080", "127.0.0.1"), origin
    for origin in ("http://127.0.0.1:8081", "http://127.0.0.1", "http://evil.example:8080", "null", "127.0.0.1:8080",
                   "ftp://127.0.0.1:8080", "http://127.0.0.1:8080/", "http://u@127.0.0.1:8080", "http://"):
        assert not rule.origin_allowed(origin, 8080, "127.0.0.1:8080", "127.0.0.1"), origin
    # behind a reverse proxy: the origin is the allowed Host the proxy forwards, on its own port
    assert rule.origin_allowed("https://box.lan", 8080, "box.lan", "127.0.0.1")
    assert not rule.origin_allowed("https://box.lan", 8080, "box.lan:8443", "127.0.0.1")
    assert not rule.origin_allowed("http://localhost:3000", 8080, "localhost:8080", "127.0.0.1")  # another local app


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_login_throttle_delays_a_client_after_its_free_failures() -> None:
    clock = FakeClock()
    throttle = LoginThrottle(clock, free=5, global_free=100, base_s=1.0, max_s=8.0)
    for _ in range(5):
        assert throttle.retry_after("a") == 0
        throttle.failed("a")
    assert throttle.retry_after("a") == 0  # 5 failures are free
    delays = []
    for _ in range(6):
        throttle.failed("a")
        delays.append(throttle.retry_after("a"))
        clock.now += delays[-1]
        assert throttle.retry_after("a") == 0
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]  # doubled, capped
    assert throttle.retry_after("b") == 0  # another address is not slowed
    throttle.succeeded("a")
    throttle.failed("a")
    assert throttle.retry_after("a") == 0  # a login forgets the address's failures


def test_the_login_throttle_holds_for_all_addresses_together_and_forgets_after_a_quiet_time() -> None:
    clock = FakeClock()
    throttle = LoginThrottle(clock, free=5, global_free=8, base_s=1.0, max_s=60.0, forget_s=100.0)
    for index in range(9):
        throttle.failed(f"10.0.0.{index}")  # one each: no address is over its own free failures
    assert throttle.retry_after("10.0.0.200") == 1.0
    clock.now += 0.5
    assert throttle.retry_after("anyone") == 0.5
    clock.now += 101
    throttle.failed("10.0.0.1")
    assert throttle.retry_after("10.0.0.1") == 0  # forgotten: counting starts again


def test_the_login_throttle_remembers_a_bounded_number_of_addresses() -> None:
    throttle = LoginThrottle(FakeClock(), free=1, global_free=10**6, max_clients=3)
    for index in range(10):
        throttle.failed(f"a{index}")
        throttle.failed(f"a{index}")
    assert list(throttle.clients) == ["a7", "a8", "a9"]
    assert throttle.retry_after("a9") == 1.0


def chunked_head(size_line: bytes) -> bytes:
    return b"POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n" + size_line


def events_of(connection: BodyLimitedConnection, data: bytes) -> list[object]:
    connection.receive_data(data)
    events: list[object] = []
    while (event := connection.next_event()) is not h11.NEED_DATA:
        events.append(event)
    return events


def test_a_chunk_larger_than_the_limit_is_refused_at_its_size_line() -> None:
    for size_line in (b"FFFFFFFFFFFFFFFF\r\n", b"65\r\n", b"65\r\nabc"):
        connection = BodyLimitedConnection(100, 16384)
        with pytest.raises(h11.RemoteProtocolError):
            events_of(connection, chunked_head(size_line))
        assert connection.refusal is not None and connection.refusal.code == "BAD_REQUEST"
        assert connection.refusal.details["chunk_bytes"] == int(size_line.split(b"\r")[0], 16)
    connection = BodyLimitedConnection(100, 16384)
    events = events_of(connection, chunked_head(b"64\r\n" + b"x" * 100 + b"\r\n0\r\n\r\n"))
    assert [type(event).__name__ for event in events] == ["Request", "Data", "EndOfMessage"]
    assert connection.refusal is None


def test_malformed_http_keeps_h11s_reason_bounded() -> None:
    connection = BodyLimitedConnection(100, 16384)
    with pytest.raises(h11.RemoteProtocolError):
        events_of(connection, b"GET / HTTP/1.1\r\n\r\n")
    assert connection.refusal is not None and connection.refusal.code == "BAD_REQUEST"
    assert "Host" in connection.refusal.details["reason"] and len(connection.refusal.details["reason"]) <= 64


# -- against a real appliance --------------------------------------------------------------------------------------


@pytest.fixture
def open_app(tiny_model: Path):  # type: ignore[no-untyped-def]
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent],
                 http_settings={"host": "127.0.0.1", "port": 0, "allowed_hosts": ["box.lan", "*.example.com"]}) as app:
        yield app


@pytest.fixture
def locked_app(tiny_model: Path):  # type: ignore[no-untyped-def]
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent],
                 http_settings={"host": "127.0.0.1", "port": 0, "api_token": TOKEN}) as app:
        yield app


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


def raw_exchange(url: str, request: bytes, timeout: float = 10) -> bytes:
    """Send ``request`` as it is on a new connection; everything the appliance answers until it closes."""
    with socket.create_connection(("127.0.0.1", port_of(url)), timeout=timeout) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def test_a_foreign_host_is_refused_on_every_path_before_any_route_runs(open_app) -> None:  # type: ignore[no-untyped-def]
    url = open_app.appliance.http_url
    port = port_of(url)
    for path in READS:
        response = httpx.get(url + path, headers={"Host": f"{EVIL}:{port}"})
        assert response.status_code == 403, (path, response.status_code)
        error = response.json()["error"]
        assert error["code"] == "FORBIDDEN" and error["details"] == {"host": EVIL}
        assert "http.allowed_hosts" in error["message"]
    posted = httpx.post(url + "/v1/chat/completions", headers={"Host": f"{EVIL}:{port}", "Origin": f"http://{EVIL}:{port}"},
                        json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
    assert posted.status_code == 403 and posted.json()["error"]["details"] == {"host": EVIL}
    assert open_app.daemon.requests.recent(10) == []  # no generation ran


def test_loopback_names_http_host_and_allowed_hosts_pass(open_app) -> None:  # type: ignore[no-untyped-def]
    url = open_app.appliance.http_url
    port = port_of(url)
    for host in ("127.0.0.1", f"127.0.0.1:{port}", "localhost", f"LOCALHOST:{port}", "app.localhost", "127.0.0.9",
                 "[::1]", f"[::1]:{port}", "box.lan", "a.example.com", f"b.a.example.com:{port}", "localhost."):
        response = httpx.get(url + "/v1/health", headers={"Host": host})
        assert response.status_code == 200, (host, response.text)
    for host in ("example.com", "xexample.com", "box.lan.evil.test", "localhost.evil.test", "10.0.0.1", "[::2]",
                 "evil.localhost.com"):
        response = httpx.get(url + "/v1/health", headers={"Host": host})
        assert response.status_code == 403, (host, response.text)


def test_a_refused_host_is_never_echoed_whole(open_app) -> None:  # type: ignore[no-untyped-def]
    url = open_app.appliance.http_url
    for name, status in (("a" * 60 + "." + "b" * 180, 403), ("a" * 60 + "." + "b" * 3000, 400)):
        response = httpx.get(url + "/v1/health", headers={"Host": name})
        assert response.status_code == status
        assert len(response.json()["error"]["details"]["host"]) <= 64 and "b" * 10 not in response.text


def test_a_malformed_host_is_a_bad_request(open_app) -> None:  # type: ignore[no-untyped-def]
    url = open_app.appliance.http_url
    for host in ("127.0.0.1:port", "127.0.0.1:99999", "::1", "[::1", "a/b", "user@127.0.0.1", ""):
        response = httpx.get(url + "/v1/health", headers={"Host": host})
        assert response.status_code == 400, (host, response.text)
        assert response.json()["error"]["code"] == "BAD_REQUEST"


def test_a_request_without_host_is_served_as_addressed_to_the_bound_address(open_app) -> None:  # type: ignore[no-untyped-def]
    answer = raw_exchange(open_app.appliance.http_url, b"GET /v1/health HTTP/1.0\r\n\r\n")
    assert answer.startswith(b"HTTP/1.1 200 OK\r\n"), answer[:200]


def test_an_unsafe_request_needs_an_allowed_origin_on_this_port(open_app) -> None:  # type: ignore[no-untyped-def]
    url = open_app.appliance.http_url
    port = port_of(url)
    csrf = {"X-CSRF-Token": open_app.appliance.csrf_token}
    for origin in (f"http://localhost:{port + 1}", f"http://{EVIL}:{port}", "http://127.0.0.1", "null",
                   f"file://127.0.0.1:{port}", f"http://127.0.0.1:{port}/path", "garbage"):
        response = httpx.post(url + "/admin/device/resync", headers={"Origin": origin, **csrf})
        assert response.status_code == 403, (origin, response.text)
        assert response.json()["error"]["message"] == "cross-origin request refused"
    for origin in (url, f"http://localhost:{port}", f"http://box.lan:{port}", f"http://[::1]:{port}"):
        response = httpx.post(url + "/admin/device/resync", headers={"Origin": origin, **csrf})
        assert response.status_code == 200, (origin, response.text)


def test_an_origin_echoed_in_a_refusal_is_truncated(open_app) -> None:  # type: ignore[no-untyped-def]
    url = open_app.appliance.http_url
    origin = "http://" + "o" * 5000 + ".test"
    response = httpx.post(url + "/v1/chat/completions", headers={"Origin": origin}, content=b"{}")
    assert response.status_code == 403 and "o" * 200 not in response.text


# -- the login page ------------------------------------------------------------------------------------------------


def test_the_login_page_and_the_admin_pages_forbid_framing_and_caching(locked_app) -> None:  # type: ignore[no-untyped-def]
    url = locked_app.appliance.http_url
    form = httpx.get(url + "/admin/login")
    assert form.status_code == 200
    with httpx.Client(base_url=url) as browser:
        browser.post("/admin/login", data={"token": TOKEN}, headers={"Origin": url})
        dashboard = browser.get("/admin/")
    assert dashboard.status_code == 200
    for response in (form, dashboard):
        assert "frame-ancestors 'none'" in response.headers["content-security-policy"]
        assert "unsafe-inline" not in response.headers["content-security-policy"]
        assert response.headers["x-frame-options"] == "DENY"
        assert response.headers["cache-control"] == "no-store"


def refused_while_delayed(url: str) -> httpx.Response:
    """The right token, sent right after a wrong one was refused with at least half a second of its delay left (on
    a slow box the 50 guesses may outlast a delay: the next guess is then compared and starts a longer one)."""
    for _ in range(10):
        wrong = httpx.post(url + "/admin/login", data={"token": "guess-again"}, headers={"Origin": url})
        left = wrong.json()["error"].get("details", {}).get("retry_after_s", 0) if "retry-after" in wrong.headers else 0
        if left >= 0.5:
            return httpx.post(url + "/admin/login", data={"token": TOKEN}, headers={"Origin": url})
        time.sleep(left)
    raise AssertionError("no wrong login was refused with half a second of its delay left")


def test_wrong_logins_are_throttled_even_the_right_token_until_the_delay_is_over(locked_app) -> None:  # type: ignore[no-untyped-def]
    url = locked_app.appliance.http_url
    start = time.monotonic()
    answers = [httpx.post(url + "/admin/login", data={"token": f"guess-{i}"}, headers={"Origin": url})
               for i in range(50)]
    elapsed = time.monotonic() - start
    assert all(answer.status_code == 401 for answer in answers)
    throttled = ["retry-after" in answer.headers for answer in answers]
    assert throttled[:7] == [False] * 6 + [True]  # 5 free failures, then the 6th starts a delay of 1 s
    assert throttled.count(False) <= 6 + math.log2(1 + elapsed)  # one more check each time a delay ran out
    refused = answers[6]
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.json()["error"]["code"] == "UNAUTHORIZED"
    assert 0 < refused.json()["error"]["details"]["retry_after_s"] <= 1
    right_too_soon = refused_while_delayed(url)
    assert right_too_soon.status_code == 401 and "retry-after" in right_too_soon.headers
    assert "appliance_session" not in right_too_soon.cookies
    deadline = time.monotonic() + 10
    accepted = right_too_soon
    while accepted.status_code != 303 and time.monotonic() < deadline:
        time.sleep(0.2)
        accepted = httpx.post(url + "/admin/login", data={"token": TOKEN}, headers={"Origin": url})
    assert accepted.status_code == 303 and "appliance_session" in accepted.cookies


def test_a_browser_sees_the_throttle_on_the_login_page(locked_app) -> None:  # type: ignore[no-untyped-def]
    url = locked_app.appliance.http_url
    html = {"Origin": url, "Accept": "text/html"}
    answers = [httpx.post(url + "/admin/login", data={"token": "nope"}, headers=html) for _ in range(7)]
    assert "That is not the API token." in answers[0].text
    assert answers[-1].status_code == 401 and "Too many wrong tokens" in answers[-1].text
    assert answers[-1].headers["content-type"].startswith("text/html")


def test_off_loopback_a_login_needs_https_and_its_cookie_is_secure(tiny_model: Path) -> None:
    """A TLS proxy on the box forwards the browser's request (uvicorn trusts its X-Forwarded-* from loopback)."""
    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent],
                 http_settings={"host": "0.0.0.0", "port": 0, "api_token": TOKEN}) as app:
        url = f"http://127.0.0.1:{port_of(app.appliance.http_url)}"
        proxied = {"Origin": url, "X-Forwarded-For": "192.0.2.7"}
        over_tls = httpx.post(url + "/admin/login", data={"token": TOKEN},
                              headers={**proxied, "X-Forwarded-Proto": "https"})
        assert over_tls.status_code == 303
        assert "; secure" in over_tls.headers["set-cookie"].lower()
        in_clear = httpx.post(url + "/admin/login", data={"token": TOKEN}, headers=proxied)
        assert in_clear.status_code == 403 and "set-cookie" not in in_clear.headers
        assert in_clear.json()["error"]["message"].startswith("Log in over HTTPS")
        local = httpx.post(url + "/admin/login", data={"token": TOKEN}, headers={"Origin": url})
        assert local.status_code == 303 and "secure" not in local.headers["set-cookie"].lower()


def test_on_loopback_the_session_cookie_is_not_secure(locked_app) -> None:  # type: ignore[no-untyped-def]
    url = locked_app.appliance.http_url
    accepted = httpx.post(url + "/admin/login", data={"token": TOKEN}, headers={"Origin": url})
    assert accepted.status_code == 303 and "secure" not in accepted.headers["set-cookie"].lower()


def test_logout_clears_the_session_cookie(locked_app) -> None:  # type: ignore[no-untyped-def]
    url = locked_app.appliance.http_url
    csrf = {"Origin": url, "X-CSRF-Token": locked_app.appliance.csrf_token}
    with httpx.Client(base_url=url) as browser:
        browser.post("/admin/login", data={"token": TOKEN}, headers={"Origin": url})
        page = browser.get("/admin/")
        assert 'hx-post="/admin/logout"' in page.text
        assert browser.post("/admin/logout", headers={"Origin": url}).status_code == 403  # no CSRF token
        assert browser.get("/v1/health").status_code == 200
        response = browser.post("/admin/logout", headers=csrf)
        assert response.status_code == 200 and response.headers["hx-redirect"] == "/admin/login"
        assert "appliance_session" not in browser.cookies
        assert browser.get("/v1/health").status_code == 401


def test_without_a_token_the_admin_page_has_no_logout(open_app) -> None:  # type: ignore[no-untyped-def]
    page = httpx.get(open_app.appliance.http_url + "/admin/")
    assert page.status_code == 200 and "/admin/logout" not in page.text
