"""The hostile suite's own checks: the end-of-case checks can fail, and garbage on the socket is harmless."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import time

import pytest
from hostile_checks import HEALTH_BOUND_MS, Prober, check_health


def test_the_health_check_fails_a_loop_that_stalls():
    """A prober that saw the loop blocked for half a second fails the case; one slow sample alone does not."""
    stalled = Prober("127.0.0.1", 0, latencies_ms=[2.0] * 50 + [500.0] * 10)
    with pytest.raises(AssertionError, match="health answers took"):
        check_health(stalled)
    hiccup = Prober("127.0.0.1", 0, latencies_ms=[2.0] * 200 + [HEALTH_BOUND_MS + 20])
    check_health(hiccup)
    hung = Prober("127.0.0.1", 0, latencies_ms=[2.0] * 1000 + [5000.0])
    with pytest.raises(AssertionError, match="took 5000 ms"):
        check_health(hung)


def test_garbage_connections(hostile):
    """Hundreds of connections sending random bytes, half-closing, or nothing at all."""
    rng = random.Random(8)
    served = hostile.neighbour.served
    for i in range(300):
        with socket.socket(socket.AF_UNIX) as sock:
            sock.settimeout(5)
            sock.connect(str(hostile.socket))
            if i % 3 == 0:
                sock.sendall(os.urandom(rng.randrange(1, 4096)))
                sock.shutdown(socket.SHUT_WR)
            elif i % 3 == 1:
                sock.sendall(b"MGNT" + os.urandom(rng.randrange(0, 64)))
                sock.shutdown(socket.SHUT_WR)
            with_reply = i % 3 != 2
            if with_reply:
                with contextlib.suppress(TimeoutError, ConnectionError):
                    sock.recv(65536)
    assert hostile.neighbour_served_since(served)
    time.sleep(0.2)
