"""The admin login's throttle of wrong tokens (:class:`LoginThrottle`): one per HTTP app, made with the app (so it
holds for the app's lifetime) while the admin page's modules are imported at its first request."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class Failures:
    """One client's (or everyone's) wrong tokens: how many since the last quiet period, the last one's time, and
    until when further attempts are refused."""

    count: int = 0
    last_at: float = 0.0
    blocked_until: float = 0.0


class LoginThrottle:
    """Wrong tokens slow the login down. After ``free`` failures from one client address, each further failure
    refuses that address's attempts for ``base_s``, then twice as long each time, at most ``max_s``; the same holds
    for all addresses together after ``global_free`` failures (many addresses cannot guess faster). A refused
    attempt is not compared with the token (the right one too) and does not count. Failures are forgotten after
    ``forget_s`` without one; at most ``max_clients`` addresses are remembered (the least recent is dropped; the
    global count still holds). Pure: ``clock`` gives the time in seconds (monotonic)."""

    def __init__(self, clock: Callable[[], float], *, free: int = 5, global_free: int = 20, base_s: float = 1.0,
                 max_s: float = 60.0, forget_s: float = 900.0, max_clients: int = 4096) -> None:
        self.clock = clock
        self.free = free
        self.global_free = global_free
        self.base_s = base_s
        self.max_s = max_s
        self.forget_s = forget_s
        self.max_clients = max_clients
        self.everyone = Failures()
        self.clients: collections.OrderedDict[str, Failures] = collections.OrderedDict()

    def retry_after(self, client: str) -> float:
        """Seconds until ``client`` may try again; 0 when it may now."""
        now = self.clock()
        own = self.clients.get(client)
        until = max(self.everyone.blocked_until, own.blocked_until if own is not None else 0.0)
        return max(0.0, until - now)

    def failed(self, client: str) -> None:
        """``client`` sent a wrong token (it was compared: :meth:`retry_after` was 0)."""
        now = self.clock()
        own = self.clients.pop(client, None) or Failures()
        self.clients[client] = own  # the most recent failure last
        while len(self.clients) > self.max_clients:
            self.clients.popitem(last=False)
        self._count(own, self.free, now)
        self._count(self.everyone, self.global_free, now)

    def succeeded(self, client: str) -> None:
        """``client`` logged in: its own failures are forgotten (everyone's are not)."""
        self.clients.pop(client, None)

    def _count(self, failures: Failures, free: int, now: float) -> None:
        if now - failures.last_at > self.forget_s:
            failures.count = 0
        failures.count += 1
        failures.last_at = now
        if failures.count > free:
            failures.blocked_until = now + self.delay(failures.count - free)

    def delay(self, over: int) -> float:
        """The delay after the ``over``-th failure past the free ones: ``base_s``, doubled each time, capped."""
        return min(self.base_s * 2.0 ** min(over - 1, 64), self.max_s)
