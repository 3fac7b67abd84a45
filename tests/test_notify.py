"""systemd's notify protocol over a real datagram socket standing in for NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket
import uuid

import pytest

from appliance.supervisor.notify import Notifier, watchdog_period_s


@pytest.fixture(params=["path", "abstract"])
def notify_socket(request, tmp_path):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    if request.param == "path":
        address = str(tmp_path / "notify")
        sock.bind(address)
    else:
        name = f"appliance-test-{uuid.uuid4().hex}"
        sock.bind("\0" + name)
        address = "@" + name
    sock.settimeout(5)
    yield sock, address
    sock.close()


def received(sock: socket.socket) -> dict[str, str]:
    data = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.split("\n"))


def test_states_arrive_in_order(notify_socket):
    sock, address = notify_socket
    notifier = Notifier(address)
    assert notifier.ready("serving 2 models")
    assert notifier.reloading()
    assert notifier.ready("serving 3 models")
    assert notifier.stopping()
    assert notifier.watchdog()
    first = received(sock)
    assert first == {"READY": "1", "STATUS": "serving 2 models"}
    reloading = received(sock)
    assert reloading["RELOADING"] == "1"
    assert int(reloading["MONOTONIC_USEC"]) > 0
    assert received(sock)["READY"] == "1"
    assert received(sock)["STOPPING"] == "1"
    assert received(sock) == {"WATCHDOG": "1"}
    assert len(notifier.sent) == 5


def test_without_notify_socket_nothing_is_sent(monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier()
    assert not notifier.enabled
    assert not notifier.ready("x")
    assert notifier.sent == []


def test_an_unreachable_socket_is_reported_not_raised(tmp_path):
    notifier = Notifier(str(tmp_path / "nobody"))
    assert not notifier.ready("x")


def test_watchdog_period_is_half_of_watchdog_usec():
    assert watchdog_period_s({"WATCHDOG_USEC": "10000000"}) == 5.0
    assert watchdog_period_s({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": str(os.getpid())}) == 5.0
    assert watchdog_period_s({"WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_period_s({}) is None
    assert watchdog_period_s({"WATCHDOG_USEC": "0"}) is None
    assert watchdog_period_s({"WATCHDOG_USEC": "junk"}) is None
