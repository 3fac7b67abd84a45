"""What a server can tell about its peer without reading from it, and how long it waits for it.

* :func:`peer_gone`: has the client closed its whole socket (not only its sending half)?
* :func:`unread_bytes`: how much of what we wrote the client has not read yet (our buffer plus the kernel's);
  a stream pauses above :data:`STREAM_HIGH_WATER` (backpressure: the kernel buffer alone holds megabytes).
* :class:`ReadClock`: the socket timeouts of one connection (header, whole request, idle), as plain arithmetic.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import select
import struct
import termios
import time
from collections.abc import Callable

from appliance.config.types import SocketConfig
from appliance.daemon.core import Daemon
from appliance.errors import ApplianceError

STREAM_HIGH_WATER = 256 * 1024
"""Bytes written and not yet read by the client above which a stream pauses its generation."""
STREAM_LOW_WATER = 64 * 1024
"""A paused stream resumes once the client left fewer unread bytes than this."""


def peer_gone(writer: asyncio.StreamWriter) -> bool:
    """After EOF: has the client closed the whole socket (POLLHUP), not just its sending half (``nc -N``)?"""
    if writer.is_closing():
        return True
    sock = writer.get_extra_info("socket")
    if sock is None:
        return True
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLHUP)
    return any(event & select.POLLHUP for _, event in poller.poll(0))


def unread_bytes(writer: asyncio.StreamWriter) -> int:
    """Bytes we wrote that the client has not read: the transport's buffer plus the socket's send queue
    (``SIOCOUTQ``; for a Unix socket the kernel counts its buffers' size, a little above the payload)."""
    transport = writer.transport
    queued = transport.get_write_buffer_size() if not transport.is_closing() else 0
    sock = writer.get_extra_info("socket")
    if sock is None:
        return queued
    with contextlib.suppress(OSError, ValueError):
        raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
        queued += struct.unpack("i", raw)[0]
    return queued


class ReadClock:
    """The read timeouts of one connection (all figures in seconds, read from the config at each use):

    * a request (line or frame) once started must arrive whole within ``request_timeout_s`` of its first byte;
    * a connection that sent nothing yet gets ``request_timeout_s`` from its accept (the header timeout);
    * with nothing started and no task running, the connection closes after ``idle_timeout_s`` without a byte
      (0 = never); while a task runs it waits for the task.

    ``settings`` gives the current ``socket`` section of the config (a reload applies at once). The session
    tells it what happens (:meth:`received`, :meth:`pending`, :meth:`busy`) and asks
    :meth:`timeout` how long the next read may wait and :meth:`expired` whether to give up when it did not come.
    """

    def __init__(self, settings: Callable[[], SocketConfig], clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        now = clock()
        self.started: float | None = now  # the start of the request being received (at accept: the header)
        self.last_activity = now  # the last byte received or task ended
        self.running = False

    def received(self) -> None:
        """Bytes arrived."""
        self.last_activity = self.clock()

    def pending(self, partial: bool) -> None:
        """Where the buffer stands: ``partial``, a request is started and not complete (its clock starts now if
        it was not running), else nothing is started."""
        if not partial:
            self.started = None
        elif self.started is None:
            self.started = self.clock()

    def busy(self, running: bool) -> None:
        """A task runs (``True``) or the last one ended (``False``: the idle clock starts now)."""
        if self.running and not running:
            self.last_activity = self.clock()
        self.running = running

    def _deadline(self) -> tuple[float | None, str]:
        if self.started is not None:
            return self.started + self.settings().request_timeout_s, "request"
        idle = self.settings().idle_timeout_s
        if self.running or idle <= 0:
            return None, ""
        return self.last_activity + idle, "idle"

    def timeout(self) -> float | None:
        """Seconds the next read may wait (None: no limit). A read that times out asks :meth:`expired`."""
        deadline, _ = self._deadline()
        if deadline is None:
            idle = self.settings().idle_timeout_s
            return idle if idle > 0 else None  # look again later: a running task may have ended meanwhile
        return max(0.0, deadline - self.clock())

    def error(self, request: str) -> ApplianceError:
        """The TIMEOUT to tell a client whose connection :meth:`expired` (``request``: "line", "frame")."""
        settings = self.settings()
        if self.expired() == "idle":
            return ApplianceError("TIMEOUT", f"nothing received for {settings.idle_timeout_s:g} s: closing",
                                  {"idle_timeout_s": settings.idle_timeout_s})
        return ApplianceError("TIMEOUT", f"the {request} did not arrive whole within {settings.request_timeout_s:g} s",
                              {"request_timeout_s": settings.request_timeout_s})

    def expired(self) -> str | None:
        """Why the connection should close now (``"request"``: a request did not arrive whole in time;
        ``"idle"``), or None."""
        deadline, reason = self._deadline()
        if deadline is not None and self.clock() >= deadline:
            return reason
        return None


async def read_within(reader: asyncio.StreamReader, clock: ReadClock, size: int) -> bytes | None:
    """Up to ``size`` bytes (``b""`` at end of stream), or None when ``clock`` says the connection timed out."""
    while True:
        try:
            async with asyncio.timeout(clock.timeout()):  # one timer, not wait_for's task per read
                chunk = await reader.read(size)
        except TimeoutError:
            if clock.expired() is not None:
                return None
            continue
        clock.received()
        return chunk


async def flush_within(writer: asyncio.StreamWriter, timeout_s: float) -> bool:
    """Wait until the transport took what we wrote; False (and the connection aborted) when the client read
    nothing for ``timeout_s`` seconds: a client that never reads must not hold a session forever."""
    try:
        await asyncio.wait_for(writer.drain(), timeout_s)
    except TimeoutError:
        writer.transport.abort()
        return False
    return True


def socket_settings(daemon: Daemon) -> SocketConfig:
    """The daemon's current ``socket`` settings (for :class:`ReadClock`: a function of the daemon, not of the
    session, so that a session and its clock form no reference cycle and a closed session's buffers are freed at
    once rather than at the next garbage collection)."""
    return daemon.config.socket
