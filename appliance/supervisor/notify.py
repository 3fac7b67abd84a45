"""systemd's notify protocol (SPEC S1): state lines as datagrams to ``$NOTIFY_SOCKET``, and the watchdog period.

The protocol is one ``AF_UNIX`` datagram per message, ``KEY=value`` lines; a socket path starting with ``@`` is in
the abstract namespace. Without ``NOTIFY_SOCKET`` (not started by systemd, or not ``Type=notify``) every call is a
no-op.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)


def watchdog_period_s(environ: Mapping[str, str] | None = None) -> float | None:
    """Seconds between WATCHDOG=1 pings: half of ``$WATCHDOG_USEC``, when it is set for this process."""
    env = os.environ if environ is None else environ
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and pid != str(os.getpid()):
        return None
    return int(usec) / 1e6 / 2


def monotonic_usec() -> int:
    """CLOCK_MONOTONIC in microseconds, as RELOADING=1 wants it in ``MONOTONIC_USEC``."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000


class Notifier:
    """Sends notify messages to the socket named by ``$NOTIFY_SOCKET`` (``address``), if any."""

    def __init__(self, address: str | None = None) -> None:
        if address is None:
            address = os.environ.get("NOTIFY_SOCKET")
        self.address = address or None
        self.sent: list[str] = []  # what was sent, for STATUS and tests

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def send(self, **fields: str | int) -> bool:
        """One datagram of ``KEY=value`` lines; False (logged once per failure) when it could not be sent."""
        if self.address is None:
            return False
        message = "\n".join(f"{key}={value}" for key, value in fields.items())
        target = self.address
        if target.startswith("@"):
            target = "\0" + target[1:]
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.connect(target)
                sock.sendall(message.encode())
        except OSError as exc:
            log.warning("cannot notify systemd at %s: %s", self.address, exc)
            return False
        self.sent.append(message)
        return True

    def ready(self, status: str) -> bool:
        return self.send(READY=1, STATUS=status)

    def reloading(self, status: str = "reloading appliance.yaml") -> bool:
        return self.send(RELOADING=1, MONOTONIC_USEC=monotonic_usec(), STATUS=status)

    def stopping(self, status: str = "stopping") -> bool:
        return self.send(STOPPING=1, STATUS=status)

    def status(self, status: str) -> bool:
        return self.send(STATUS=status)

    def watchdog(self) -> bool:
        return self.send(WATCHDOG=1)
