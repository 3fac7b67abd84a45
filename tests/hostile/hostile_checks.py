"""What the hostile suite measures during a case, and the checks every case must pass (see conftest.py)."""

from __future__ import annotations

import http.client
import os
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness import Running

PROBE_PERIOD_S = 0.02
HEALTH_BOUND_MS = 100.0
"""Every ``/v1/health`` answer during a case must take less than this (the issue's bound)."""
HEALTH_SLACK_SAMPLES = 0.01
"""Share of health samples allowed above the bound: the test process shares 2 cores with llama.cpp's threads and
with the hostile clients themselves, so a rare scheduling hiccup is the machine, not the daemon. A daemon whose
loop is blocked misses the bound on every sample taken while it is blocked."""
HEALTH_HANG_MS = 1000.0
"""No health answer may ever take this long: that is a stalled loop whatever the machine."""
NEIGHBOUR_PERIOD_S = 0.05
NEIGHBOUR_TOKENS = 2
NEIGHBOUR_RESTART = 100  # decodes before the neighbour re-registers (its conversation would fill the context)
FD_SLACK = 2
SETTLE_S = 10.0  # how long teardown waits for fds to come back to their baseline
HUNG_S = 30.0  # a neighbour request or liveness check slower than this is a hang


def rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def files_under(*folders: Path) -> set[Path]:
    found: set[Path] = set()
    for folder in folders:
        for path in folder.rglob("*"):
            if path.is_file() or path.is_socket():
                found.add(path)
    return found



# -- the background clients ----------------------------------------------------------------------------------------


@dataclass
class Prober:
    """``GET /v1/health`` every :data:`PROBE_PERIOD_S` on one kept-alive connection, timing each answer."""

    host: str
    port: int
    latencies_ms: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    rss_peak: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=HUNG_S)
        while not self.stop.is_set():
            start = time.perf_counter()
            try:
                conn.request("GET", "/v1/health")
                response = conn.getresponse()
                body = response.read()
                if response.status != 200 or b'"status"' not in body:
                    self.failures.append(f"HTTP {response.status}: {body[:200]!r}")
            except (OSError, http.client.HTTPException) as exc:
                self.failures.append(f"{type(exc).__name__}: {exc}")
                conn.close()
                conn = http.client.HTTPConnection(self.host, self.port, timeout=HUNG_S)
            self.latencies_ms.append((time.perf_counter() - start) * 1000)
            self.rss_peak = max(self.rss_peak, rss_bytes())
            self.stop.wait(PROBE_PERIOD_S)
        conn.close()


def request(sock: socket.socket, reader: Any, line: str) -> str:
    """Send one line-protocol command on an open connection (``reader``: its binary file) and read its reply."""
    sock.sendall(line.encode() + b"\n")
    lines = []
    while True:
        raw = reader.readline()
        if not raw:
            raise ConnectionError("the daemon closed the connection")
        text = raw.decode()
        lines.append(text)
        if text.startswith("ERR ") or text == "END_RESPONSE\n":
            return "".join(lines)


@dataclass
class Neighbour:
    """A well-behaved line client: its own agent, a few tokens per DECODE, one request every
    :data:`NEIGHBOUR_PERIOD_S`; counts what it was served and how long each answer took."""

    socket_path: Path
    model: str
    served: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        generation = 0
        while not self.stop.is_set():
            generation += 1
            agent = f"neighbour-{generation}"
            try:
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.settimeout(HUNG_S)
                    sock.connect(str(self.socket_path))
                    reader = sock.makefile("rb")
                    reply = request(sock, reader, f"REGISTER {agent} {self.model}")
                    if reply.startswith("ERR"):
                        raise RuntimeError(reply.strip())
                    for _ in range(NEIGHBOUR_RESTART):
                        if self.stop.is_set():
                            break
                        start = time.perf_counter()
                        reply = request(sock, reader, f"DECODE {agent} {NEIGHBOUR_TOKENS} hello")
                        self.latencies_ms.append((time.perf_counter() - start) * 1000)
                        if reply.startswith("ERR"):
                            raise RuntimeError(reply.strip())
                        self.served += 1
                        self.stop.wait(NEIGHBOUR_PERIOD_S)
                    request(sock, reader, f"UNREGISTER {agent}")
            except (OSError, RuntimeError, ConnectionError) as exc:
                self.errors.append(f"{type(exc).__name__}: {exc}")
                self.stop.wait(0.2)


def alive(app: Running) -> bool | None:
    """True: STATUS answered OK; False: it hung; None: the daemon is gone (refused or errored)."""
    try:
        reply = app.line("STATUS", timeout=HUNG_S)
    except TimeoutError:
        return False
    except OSError:
        return None
    return reply.startswith("OK ")


def check_health(prober: Prober) -> None:
    latencies = prober.latencies_ms
    assert not prober.failures, f"/v1/health failed during the case: {prober.failures[:3]}"
    assert latencies, "the prober took no sample"
    slow = [ms for ms in latencies if ms >= HEALTH_BOUND_MS]
    assert max(latencies) < HEALTH_HANG_MS, f"/v1/health took {max(latencies):.0f} ms"
    assert len(slow) <= max(1, HEALTH_SLACK_SAMPLES * len(latencies)), (
        f"{len(slow)} of {len(latencies)} health answers took ≥ {HEALTH_BOUND_MS:g} ms "
        f"(median {statistics.median(latencies):.1f} ms, max {max(latencies):.0f} ms)")


def settled_fds(baseline: int) -> int:
    """Open fds once they are back within :data:`FD_SLACK` of ``baseline``, or after :data:`SETTLE_S`."""
    deadline = time.monotonic() + SETTLE_S
    while open_fds() > baseline + FD_SLACK and time.monotonic() < deadline:
        time.sleep(0.05)
    return open_fds()
