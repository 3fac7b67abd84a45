"""HTTP fuzz and the auth matrix (issue: "the rest of this round's cases").

* **Fuzz.** A seeded generator writes malformed HTTP (request lines, headers, framing, bodies) on raw sockets, and
  well-framed requests with hostile JSON bodies (wrong types, huge numbers, deep nesting, invalid UTF-8, NULs) on a
  kept-alive httpx client, to the OpenAI routes, ``/metrics``, ``/v1/health`` and ``/admin/*``. Every answer must be
  a well-formed HTTP response, an error one with a P4 JSON body whose code matches its status, never ``INTERNAL``
  and never a hang; a client that leaves before its body arrived is not counted or logged as an ``INTERNAL`` error
  either. The only other ending allowed is a clean close of a connection whose HTTP could not be parsed.
* **Auth matrix.** With ``http.api_token`` set, every route is tried with no token, wrong ones, the bearer token and
  the session cookie from ``/admin/login``: 401 (or 303 to the login form for a browser's page) without the token,
  through the guard with it; the token is in no response's body or headers. It runs its own appliance (and records
  its row with ``record_case``): the fixture's prober asks ``/v1/health`` without a token.
"""

from __future__ import annotations

import http.client
import json
import logging
import random
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from harness import running
from hostile_checks import HUNG_S
from starlette.routing import BaseRoute, Route

from appliance.errors import TABLE
from appliance.http.lazyroutes import LazyRoutes

SEED = 20250611
RAW_PROBES = 160
JSON_PROBES = 160
ANSWER_S = 10.0
"""One answer slower than this is a hang (each fuzz request is refused or generates at most 2 tokens)."""
FUZZ_BOUND_S = 60.0
"""The whole fuzz run (a few seconds on the 2-core box)."""
TOKEN = "hostile-matrix-token-5f2c9a"


# -- what an answer must be (pure) ------------------------------------------------------------------------------------


def answer_problem(status: int, content_type: str, body: bytes, *, head: bool = False) -> str | None:
    """What is wrong with one HTTP answer, or None: an error status must carry a P4 JSON body whose code is one of
    the table's with this status; nothing may be a 500 or ``INTERNAL``."""
    if status == 500:
        return f"HTTP 500: {body[:200]!r}"
    if status < 400:
        return None
    if not content_type.startswith("application/json"):
        return f"HTTP {status} with content-type {content_type!r}: {body[:200]!r}"
    if head:
        return None
    try:
        error = json.loads(body.decode("utf-8"))["error"]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError):
        return f"HTTP {status} without a P4 body: {body[:200]!r}"
    if not isinstance(error, dict) or error.get("code") not in TABLE:
        return f"HTTP {status} with an unknown error code: {body[:200]!r}"
    kind = TABLE[error["code"]]
    if error["code"] == "INTERNAL":
        return f"INTERNAL: {body[:200]!r}"
    if kind.http_status != status or error.get("retryable") is not kind.retryable:
        return f"HTTP {status} for {error['code']} (the table says {kind.http_status}): {body[:200]!r}"
    if not isinstance(error.get("message"), str) or not error["message"] or not isinstance(error.get("details"),
                                                                                           dict):
        return f"HTTP {status}: a P4 error needs a message and details: {body[:200]!r}"
    return None


def test_the_answer_check_refuses_what_it_must():
    good = json.dumps({"error": {"code": "BAD_REQUEST", "message": "m", "retryable": False, "details": {}}}).encode()
    assert answer_problem(400, "application/json", good) is None
    assert answer_problem(200, "text/html", b"<html>") is None
    assert "content-type" in (answer_problem(400, "text/plain; charset=utf-8", b"Invalid HTTP request received.")
                              or "")
    assert "the table says 400" in (answer_problem(404, "application/json", good) or "")
    internal = json.dumps({"error": {"code": "INTERNAL", "message": "m", "retryable": False, "details": {}}})
    assert "HTTP 500" in (answer_problem(500, "application/json", internal.encode()) or "")
    assert "without a P4 body" in (answer_problem(400, "application/json", b"{}") or "")
    assert answer_problem(405, "application/json", b"", head=True) is None


# -- the fuzz probes (pure: bytes from a seeded generator) -------------------------------------------------------------


@dataclass(frozen=True)
class RawProbe:
    """Bytes for one raw connection. ``parseable``: well-formed HTTP, so an answer is required (else a clean close
    is allowed too); ``half_close``: the client stops sending after ``data`` (an aborted upload)."""

    kind: str
    data: bytes
    method: str = "GET"
    parseable: bool = False
    half_close: bool = False
    answers: int = 1


ROUTES = (("GET", "/v1/models"), ("GET", "/v1/models/demo"), ("GET", "/metrics"), ("GET", "/v1/health"),
          ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/admin/"),
          ("GET", "/admin/registry"), ("POST", "/admin/registry/register"), ("POST", "/admin/config/reload"),
          ("GET", "/admin/benchmarks/result/x.json"), ("GET", "/admin/chat"), ("GET", "/static/admin.js"))
GARBAGE_PATHS = ("/v1/mo%00dels", "/%ff%fe%zz", "/v1/models/%2e%2e%2f%2e%2e%2fetc%2fpasswd", "/static/../../etc/passwd",
                 "/admin/benchmarks/result/..%2f..%2fregistry.json", "/v1/models/" + "a" * 5000, "/metrics?x=%00%ff",
                 "/admin/registry/_tables?" + "&" * 3000, "//v1//models", "/v1/completions/")


def random_bytes(rng: random.Random, size: int) -> bytes:
    return bytes(rng.randrange(256) for _ in range(size))


def request_head(method: str, target: str, host: str, headers: list[tuple[str, str]] | None = None,
                 version: str = "HTTP/1.1") -> bytes:
    lines = [f"{method} {target} {version}", f"Host: {host}", *(f"{k}: {v}" for k, v in headers or [])]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def raw_probe(rng: random.Random, host: str) -> RawProbe:
    """One malformed (or oddly formed) request on its own connection."""
    method, path = rng.choice(ROUTES)
    body = json.dumps({"model": "demo", "prompt": "x", "max_tokens": 1}).encode()
    choice = rng.randrange(16)
    if choice == 0:
        return RawProbe("garbage line", random_bytes(rng, rng.randrange(1, 300)) + b"\r\n\r\n")
    if choice == 1:
        version = rng.choice(["HTTP/2.0", "HTTP/0.9", "HTTP/1.1x", "HTTP/11", "", "HTTP/1.1 extra", "http/1.1"])
        return RawProbe("bad version", request_head(method, path, host, version=version))
    if choice == 2:
        return RawProbe("no host", f"{method} {path} HTTP/1.1\r\nContent-Length: 0\r\n\r\n".encode())
    if choice == 3:
        target = path + rng.choice(["\x00", "\x7f", " x", "\t", "\u00e9"])
        return RawProbe("bad target", request_head(method, target, host))
    if choice == 4:
        line = rng.choice([b"NoColonHere", b"Bad Name: x", b" folded: continuation", b"X: a\x00b", b"X: a\rb",
                           b": empty-name", b"X-\xff: y"])
        head = request_head(method, path, host)
        return RawProbe("bad header", head[:-2] + line + b"\r\n\r\n", method)
    if choice == 5:
        lengths = rng.choice([["5", "6"], ["-1"], ["abc"], ["1" * 30], ["+5"], ["0x10"], ["5, 6"]])
        head = request_head("POST", "/v1/completions", host, [("Content-Length", n) for n in lengths])
        return RawProbe("bad content-length", head + b"hello", "POST")
    if choice == 6:
        framing = rng.choice([[("Transfer-Encoding", "gzip")], [("Transfer-Encoding", "chunked, gzip")],
                              [("Transfer-Encoding", "chunked"), ("Content-Length", "3")]])
        chunk = rng.choice([b"zz\r\nhello\r\n0\r\n\r\n", b"5;" + b"x" * 100 + b"\r\nhello\r\n0\r\n\r\n",
                            b"-1\r\n\r\n", b"ffffffffffffffffffff\r\n"])
        return RawProbe("bad chunked body", request_head("POST", "/v1/completions", host, framing) + chunk, "POST")
    if choice == 7:
        head = request_head("POST", rng.choice(["/v1/completions", "/v1/chat/completions", "/admin/login",
                                                "/admin/registry/register"]), host,
                            [("Content-Length", str(len(body) + rng.randrange(1, 1000)))])
        return RawProbe("aborted upload", head + body[:rng.randrange(len(body))], "POST", half_close=True)
    if choice == 8:
        head = request_head("POST", "/v1/completions", host, [("Transfer-Encoding", "chunked")])
        return RawProbe("aborted chunked upload", head + b"10\r\n" + body[:7], "POST", half_close=True)
    if choice == 9:
        first = request_head("GET", "/v1/health", host)
        return RawProbe("pipelined then garbage", first + random_bytes(rng, 40) + b"\r\n\r\n", answers=2)
    if choice == 10:
        payload = rng.choice([random_bytes(rng, 64), b"\xff\xfe\x00", b'{"model": "demo\x00"', b"\x00" * 32,
                              b'{"model":"demo","prompt":"\xed\xa0\x80","max_tokens":1}', b"[" * 5000])
        head = request_head(rng.choice(["POST", "PUT", "DELETE", "PATCH"]), rng.choice(["/v1/completions",
                                                                                         "/v1/chat/completions"]),
                            host, [("Content-Length", str(len(payload))), ("Content-Type", "application/json")])
        return RawProbe("bad body", head + payload, "POST", parseable=True)
    if choice == 11:
        head = request_head("POST", "/v1/completions", host, [("Content-Length", str(len(body))),
                                                              ("Expect", "100-continue")])
        return RawProbe("expect 100-continue", head + body, "POST", parseable=True)
    if choice == 12:
        return RawProbe("garbage path", request_head("GET", rng.choice(GARBAGE_PATHS), host), parseable=True)
    if choice == 13:
        verb = rng.choice(["FOO", "get", "TRACE", "CONNECT", "OPTIONS", "PROPFIND", "G" * 300])
        return RawProbe("odd method", request_head(verb, path, host), verb, parseable=verb.isupper())
    if choice == 14:
        target = rng.choice(["*", "http://evil.example/v1/models", "v1/models", "/v1/models#frag", "?"])
        return RawProbe("odd target", request_head("GET", target, host))
    header = rng.choice([("Authorization", "Bearer " + "x" * 8000), ("Cookie", "appliance_session=\x7f" * 50),
                         ("X-Agent-Id", "\u00e9\u00e8"), ("Accept", "text/html"), ("Content-Type", "x/\x01"),
                         ("X-Big", "a" * 12000), ("Origin", "null"), ("Sec-Fetch-Site", "cross-site")])
    head = request_head(method, path, host, [header, ("Content-Length", "0")])
    return RawProbe("odd header", head, method, parseable=header[0] not in ("Content-Type", "Cookie"))


HOSTILE_VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1.5, 2**31, 2**64, -(2**63) - 1, 1e308, -1e308, "", "x" * 5000, "\x00", "\ud800",
    "\u202e\u0000\uffff", [], {}, [None], {"a": None}, [[[[[[[[[[[[]]]]]]]]]]]], "<script>alert(1)</script>",
    "demo", "demo-b", 1, 2, "1", [1, 2], {"type": "text"}, ["x"] * 20, "\\u0000",
)
NUMBER_TEXTS = ("1e999", "-1e999", "1" * 5000, "NaN", "Infinity", "-0", "1.0e-400", "0x10", "01")
CHAT_TEMPLATE = {"model": "demo", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                 "temperature": 0}
COMPLETION_TEMPLATE = {"model": "demo", "prompt": "hi", "max_tokens": 1, "temperature": 0}
FIELDS = ("model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "seed", "stop", "stream", "stream_options", "n", "user", "logit_bias", "logprobs", "tools", "echo",
          "response_format", "unknown_field", "messages.0.role", "messages.0.content", "messages.0.name")
GENERATION_FIELDS = ("max_tokens", "max_completion_tokens")


def set_path(document: dict[str, Any], path: str, value: Any) -> None:
    """Set ``a.0.b`` in a JSON document, creating nothing: a path that does not exist is set at the top level."""
    parts = path.split(".")
    target: Any = document
    for part in parts[:-1]:
        key: Any = int(part) if part.isdigit() else part
        try:
            target = target[key]
        except (KeyError, IndexError, TypeError):
            document[path] = value
            return
    last: Any = int(parts[-1]) if parts[-1].isdigit() else parts[-1]
    try:
        target[last] = value
    except (IndexError, TypeError):
        document[path] = value


def json_probe(rng: random.Random) -> tuple[str, bytes]:
    """A well-framed POST body: a valid request with one to three fields made hostile, or a body that is not a JSON
    object at all. A request that stays valid generates at most 2 tokens."""
    path, template = rng.choice((("/v1/chat/completions", CHAT_TEMPLATE), ("/v1/completions", COMPLETION_TEMPLATE)))
    document = json.loads(json.dumps(template))
    shape = rng.randrange(10)
    if shape == 0:
        return path, rng.choice([b"", b"null", b"[]", b"\"x\"", b"{", b"{\"model\":", b"\xff" * 8, b"{}" * 3,
                                 b"[" * 100_000 + b"]" * 100_000, b"{\"a\":" * 70 + b"1" + b"}" * 70])
    if shape == 1:
        number = rng.choice(NUMBER_TEXTS)
        text = json.dumps(document).replace('"max_tokens": 1', f'"max_tokens": {number}')
        return path, text.encode()
    for _ in range(rng.randrange(1, 4)):
        field = rng.choice(FIELDS)
        value = rng.choice(HOSTILE_VALUES)
        if field in GENERATION_FIELDS and value is None:
            value = 0  # null would mean "as many as the context holds": a long generation, not a fuzz case
        if rng.random() < 0.15 and field not in GENERATION_FIELDS:
            document.pop(field, None)
        else:
            set_path(document, field, value)
    text = json.dumps(document, ensure_ascii=rng.random() < 0.5)
    if rng.random() < 0.1:
        text = text.replace("hi", "h\x00i")
    return path, text.encode("utf-8", "surrogatepass")


def form_probe(rng: random.Random) -> tuple[str, bytes]:
    """An admin POST with a random form (refused or a harmless action: never the neighbour's agent or model)."""
    path = rng.choice(["/admin/registry/register", "/admin/registry/unregister", "/admin/registry/load",
                       "/admin/registry/unload", "/admin/device/resync", "/admin/config/reload",
                       "/admin/benchmarks/run", "/admin/benchmarks/result/x.json/apply"])
    fields = {rng.choice(["agent", "model", "quick", "in_place", "x"]): rng.choice(
        ["", "fz-" + str(rng.randrange(1000)), "demo-b", "<b>", "a" * 300, "\x00", "%ff", "nope"])
              for _ in range(rng.randrange(4))}
    body = "&".join(f"{k}={v}" for k, v in fields.items()).encode("utf-8", "replace")
    if rng.random() < 0.2:
        body = random_bytes(rng, 200)
    return path, body


# -- running the probes -----------------------------------------------------------------------------------------------


@dataclass
class Answer:
    status: int
    content_type: str
    body: bytes
    outcome: str | None  # the admin actions' X-Appliance-Outcome header


class MalformedAnswer(Exception):
    """What came back is not an HTTP response."""


class Connection:
    """A raw connection's one buffered reader, shared by the responses read from it: a reader per response would
    lose what the first one read ahead (pipelined answers arrive together). ``http.client`` closes its reader at
    the end of each response: here that keeps the reader open."""

    def __init__(self, sock: socket.socket) -> None:
        self.reader = sock.makefile("rb")

    def makefile(self, mode: str) -> Connection:
        return self

    def __getattr__(self, name: str) -> Any:
        return getattr(self.reader, name)

    def close(self) -> None:
        return None


def read_answer(connection: Connection, method: str) -> Answer | None:
    """The next HTTP response on ``connection`` (None: the daemon closed without one); a timeout is a hang."""
    response = http.client.HTTPResponse(connection, method=method)  # type: ignore[arg-type]
    try:
        response.begin()
        body = response.read()
    except (http.client.RemoteDisconnected, ConnectionResetError):
        return None
    except TimeoutError:
        raise AssertionError(f"no answer within {ANSWER_S:g} s") from None
    except http.client.HTTPException as exc:
        raise MalformedAnswer(f"{type(exc).__name__}: {exc}") from None
    return Answer(response.status, response.getheader("content-type", ""), body,
                  response.getheader("x-appliance-outcome"))


def run_raw(address: tuple[str, int], probe: RawProbe) -> list[str]:
    problems = []
    with socket.create_connection(address, timeout=ANSWER_S) as sock:
        try:
            sock.sendall(probe.data)
            if probe.half_close:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the daemon refused the start and closed: what it answered is read below
        connection = Connection(sock)
        try:
            problems += read_answers(connection, probe)
        finally:
            connection.reader.close()
    return problems


def read_answers(connection: Connection, probe: RawProbe) -> list[str]:
    problems = []
    for index in range(probe.answers):
        try:
            answer = read_answer(connection, probe.method)
        except MalformedAnswer as exc:
            return [f"{probe.kind}: not an HTTP response ({exc}) to {probe.data[:120]!r}"]
        if answer is None:
            required = probe.parseable and index == 0 or index < probe.answers - 1
            if required:
                problems.append(f"{probe.kind}: closed without an answer: {probe.data[:120]!r}")
            return problems
        problem = answer_problem(answer.status, answer.content_type, answer.body, head=probe.method == "HEAD")
        if problem is not None:
            problems.append(f"{probe.kind}: {problem} (sent {probe.data[:120]!r})")
    return problems


class Collect(logging.Handler):
    """Log records of ERROR and above, from loggers that may not propagate to the root (uvicorn's)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@contextmanager
def errors_logged(*names: str) -> Iterator[Collect]:
    collect = Collect()
    loggers = [logging.getLogger(name) for name in names]
    for logger in loggers:
        logger.addHandler(collect)
    try:
        yield collect
    finally:
        for logger in loggers:
            logger.removeHandler(collect)


def test_fuzzed_http_gets_p4_answers_and_the_daemon_keeps_serving(hostile):
    """Malformed HTTP on raw sockets, hostile JSON and forms on a kept-alive client: every answer well-formed, every
    error a P4 body matching its status, none INTERNAL, none slower than ANSWER_S; no INTERNAL counted and no
    error logged for a client that left mid-body; the neighbour is served and the daemon still answers."""
    host, port = hostile.http.removeprefix("http://").rsplit(":", 1)
    address = (host, int(port))
    rng = random.Random(SEED)
    problems: list[str] = []
    kinds: dict[str, int] = {}
    served = hostile.neighbour.served
    started = time.monotonic()
    csrf = {"X-CSRF-Token": hostile.app.appliance.csrf_token}
    with errors_logged("appliance", "uvicorn.error") as logged:
        for _ in range(RAW_PROBES):
            probe = raw_probe(rng, f"{host}:{port}")
            kinds[probe.kind] = kinds.get(probe.kind, 0) + 1
            problems += run_raw(address, probe)
        with httpx.Client(base_url=hostile.http, timeout=ANSWER_S) as client:
            for index in range(JSON_PROBES):
                if index % 4 == 3:
                    path, body = form_probe(rng)
                    headers = {"Content-Type": "application/x-www-form-urlencoded", **(csrf if index % 8 == 3 else {})}
                else:
                    path, body = json_probe(rng)
                    headers = {"Content-Type": "application/json"}
                try:
                    response = client.post(path, content=body, headers=headers)
                except httpx.TimeoutException:
                    problems.append(f"POST {path}: no answer within {ANSWER_S:g} s: {body[:120]!r}")
                    continue
                problem = answer_problem(response.status_code, response.headers.get("content-type", ""),
                                         response.content)
                outcome = response.headers.get("x-appliance-outcome")
                if problem is None and outcome is not None and (outcome != "ok" and outcome not in TABLE
                                                                or outcome == "INTERNAL"):
                    problem = f"admin outcome {outcome}"
                if problem is not None:
                    problems.append(f"POST {path}: {problem} (sent {body[:120]!r})")
        elapsed = time.monotonic() - started
    print(f"{RAW_PROBES} raw and {JSON_PROBES} JSON/form probes in {elapsed:.1f} s; raw kinds: {kinds}")
    assert not problems, f"{len(problems)} bad answers, first: {problems[:5]}"
    internal = {key: count for key, count in dict(hostile.app.daemon.errors).items() if key[1] == "INTERNAL"}
    assert not internal, f"INTERNAL errors counted: {internal}"
    assert not logged.records, [f"{r.name}: {r.getMessage()}" for r in logged.records[:3]]
    assert elapsed < FUZZ_BOUND_S, f"the fuzz took {elapsed:.0f} s"
    after = httpx.post(hostile.http + "/v1/completions", json=COMPLETION_TEMPLATE, timeout=HUNG_S)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 1
    assert hostile.neighbour_served_since(served)


# -- the auth matrix --------------------------------------------------------------------------------------------------

PATH_PARAMS = {"model": "demo", "file": "none.json", "response_id": "resp_none"}
"""What each path parameter of a route is filled with."""
EXTRA_ROUTES = (("GET", "/static/admin.js"), ("GET", "/no/such/route"), ("POST", "/admin/no/such/route"))
"""Besides the app's routes: a static file (a mount) and paths of no route."""
NOT_RUN = frozenset({("POST", "/admin/benchmarks/run")})
"""Tried only without the token: with it, it starts benchmark processes."""
APART = frozenset({("POST", "/admin/login"), ("POST", "/admin/logout")})
"""Tried apart from the matrix: the login form (its wrong tokens are throttled) before it, logout (it ends the
cookie's session) after it."""
POST_BODIES: dict[str, tuple[str, bytes]] = {
    "/v1/completions": ("application/json", json.dumps(COMPLETION_TEMPLATE).encode()),
    "/v1/chat/completions": ("application/json", json.dumps(CHAT_TEMPLATE).encode()),
    "/admin/registry/register": ("application/x-www-form-urlencoded", b"agent=matrix&model=demo"),
    "/admin/registry/unregister": ("application/x-www-form-urlencoded", b"agent=matrix"),
    "/admin/registry/load": ("application/x-www-form-urlencoded", b"model=demo"),
    "/admin/registry/unload": ("application/x-www-form-urlencoded", b"model=demo"),
    "/v1/messages": ("application/json", json.dumps({"model": "demo", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}]}).encode()),
    "/v1/messages/count_tokens": ("application/json", json.dumps({"model": "demo", "messages": [
        {"role": "user", "content": "hi"}]}).encode()),
    "/v1/responses": ("application/json", json.dumps({"model": "demo", "input": "hi", "max_output_tokens": 2,
                                                      "store": False}).encode()),
    "/v1/responses/input_tokens": ("application/json", json.dumps({"model": "demo", "input": "hi"}).encode()),
    "/v1/embeddings": ("application/json", json.dumps({"model": "demo", "input": "hi"}).encode()),
}
"""A request each POST route does something with (the others are sent without a body)."""
KNOWN_ANSWERS = {("GET", "/"): 307, ("GET", "/admin"): 307, ("GET", "/admin/benchmarks/result/none.json"): 404,
                 ("GET", "/v1/responses/resp_none"): 404, ("DELETE", "/v1/responses/resp_none"): 404,
                 ("POST", "/v1/embeddings"): 400,  # demo is not an embeddings model: through the guard, refused
                 ("GET", "/no/such/route"): 404, ("POST", "/admin/no/such/route"): 404}
"""With the token: what a route answers when it is not 200 (a redirect to /admin/, no such result or route)."""
OPEN_ROUTES = frozenset({("GET", "/admin/login")})
"""Reachable without the token: the login form."""


def app_routes(app: Any) -> list[BaseRoute]:
    """The HTTP app's routes, those of a family imported at its first request (:class:`LazyRoutes`) in its place."""
    found: list[BaseRoute] = []
    for route in app.routes:
        found += route.routes if isinstance(route, LazyRoutes) else [route]
    return found


def matrix_routes(app: Any) -> list[tuple[str, str]]:
    """(method, path) of every route of the HTTP app (HEAD aside), path parameters filled in, and EXTRA_ROUTES."""
    found = []
    for route in app_routes(app):
        if isinstance(route, Route):
            path = route.path_format.format(**PATH_PARAMS)
            found += [(method, path) for method in sorted((route.methods or set()) - {"HEAD"})]
    return [*found, *EXTRA_ROUTES]


def credentials(login_cookie: str) -> dict[str, dict[str, str]]:
    return {
        "none": {},
        "wrong bearer": {"Authorization": f"Bearer {TOKEN}x"},
        "token as basic": {"Authorization": f"Basic {TOKEN}"},
        "wrong cookie": {"Cookie": "appliance_session=" + "0" * 64},
        "bearer": {"Authorization": f"Bearer {TOKEN}"},
        "lower-case bearer": {"Authorization": f"bearer {TOKEN}"},
        "cookie": {"Cookie": f"appliance_session={login_cookie}"},
    }


AUTHORIZED = frozenset({"bearer", "lower-case bearer", "cookie"})


def leaks(response: httpx.Response) -> list[str]:
    """Where the token appears in a response: its body or a header."""
    found = []
    if TOKEN in response.text:
        found.append("body")
    found += [f"header {name}" for name, value in response.headers.items() if TOKEN in value]
    return found


def login_cookie(client: httpx.Client) -> str:
    refused = client.post("/admin/login", data={"token": TOKEN + "x"})
    assert refused.status_code == 401 and not leaks(refused)
    accepted = client.post("/admin/login", data={"token": TOKEN})
    assert accepted.status_code == 303 and accepted.headers["location"] == "/admin/", accepted.text
    assert not leaks(accepted)
    cookie = client.cookies.get("appliance_session")
    assert cookie, accepted.headers
    client.cookies.clear()  # each matrix request says its own credentials
    return cookie


def ask(client: httpx.Client, method: str, path: str, headers: dict[str, str], accept: str) -> httpx.Response:
    """One request with exactly ``headers`` for credentials (a cookie a response set is not kept)."""
    kind, body = POST_BODIES.get(path, ("application/json", b""))
    try:
        if method == "GET":
            return client.get(path, headers={**headers, "Accept": accept})
        return client.request(method, path, content=body,
                              headers={**headers, "Content-Type": kind, "Accept": accept})
    finally:
        client.cookies.clear()


def test_the_auth_matrix_holds_on_every_route(record_case, tiny_model: Path):
    """Every route of the app (and a static file, and paths of no route) x {no token, wrong token, token as Basic,
    wrong cookie, bearer, lower-case bearer, login cookie}, as an API client and as a browser: without the token
    401 UNAUTHORIZED (a browser's admin page: 303 to /admin/login), with it through the guard (200 or the route's
    own answer); only the login form needs no token; the token is in no body or header, the config page's file
    text included. The login form's POST is tried before (a wrong token, then the right one), logout last."""
    crashed = True
    wrong: list[str] = []
    with running({"demo": {"path": str(tiny_model), "n_ctx": 512}}, model_dirs=[tiny_model.parent], watch=True,
                 http_settings={"host": "127.0.0.1", "port": 0, "api_token": TOKEN}) as app:
        routes = matrix_routes(app.appliance.http_server.config.app)
        csrf = {"X-CSRF-Token": app.appliance.csrf_token}
        with httpx.Client(base_url=app.appliance.http_url or "", timeout=HUNG_S) as client:
            assert client.get("/admin/login").status_code == 200
            cookie = login_cookie(client)
            for who, headers in credentials(cookie).items():
                for method, path in routes:
                    if (method, path) in APART or who in AUTHORIZED and (method, path) in NOT_RUN:
                        continue
                    for accept in ("application/json", "text/html"):
                        response = ask(client, method, path, {**headers, **csrf}, accept)
                        wrong += check_matrix(who, method, path, accept, response)
            for who in ("none", "wrong cookie", "cookie"):  # logout last: it ends the cookie's session
                response = ask(client, "POST", "/admin/logout", {**credentials(cookie)[who], **csrf}, "text/html")
                wrong += [f"{who} POST /admin/logout: the token is in the {place}" for place in leaks(response)]
                if (response.status_code == 401) == (who in AUTHORIZED):
                    wrong.append(f"{who} POST /admin/logout: HTTP {response.status_code}")
        crashed = not app.line("STATUS").startswith("OK")
    record_case(crashed=crashed)
    assert ("GET", "/v1/health") in routes and len(routes) > 25, routes
    assert not wrong, f"{len(wrong)} wrong answers, first: {wrong[:5]}"


def check_matrix(who: str, method: str, path: str, accept: str, response: httpx.Response) -> list[str]:
    """What is wrong with one cell of the matrix."""
    where = f"{who} {method} {path} ({accept})"
    problems = [f"{where}: the token is in the {place}" for place in leaks(response)]
    status = response.status_code
    location = response.headers.get("location")
    if who in AUTHORIZED or (method, path) in OPEN_ROUTES:
        expected = KNOWN_ANSWERS.get((method, path), 200)
        if status != expected:
            problems.append(f"{where}: HTTP {status} {location or ''}, expected {expected}: {response.text[:150]}")
        elif status == 307 and location != "/admin/":
            problems.append(f"{where}: redirected to {location}")
        return problems
    if method == "GET" and path.startswith("/admin") and accept == "text/html":
        if status != 303 or location != "/admin/login":
            problems.append(f"{where}: HTTP {status} {location}, expected 303 to the login form")
        return problems
    problem = answer_problem(status, response.headers.get("content-type", ""), response.content)
    if status != 401 or problem is not None or response.json()["error"]["code"] != "UNAUTHORIZED":
        problems.append(f"{where}: HTTP {status}, expected 401 UNAUTHORIZED: {problem or response.text[:150]}")
    return problems
