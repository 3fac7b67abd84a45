"""The order in which a model's waiting requests start: round-robin over their queue keys (a connection, an
agent), first come first served within a key. Pure.

A model's live context has ``live_slots`` sequences; when they are all busy, the requests that want one wait here,
and a new request that finds others waiting queues behind them. Only the request at the :meth:`Admission.head`
tries to start, so a client with 64 requests queued waits its turn like everyone else: the next sequence freed goes
to the next key in the ring, not to the oldest request overall.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable


class Admission:
    """Tickets waiting to start, one FIFO per key, keys served in turn."""

    def __init__(self) -> None:
        self._queues: dict[Hashable, collections.deque[object]] = {}
        self._ring: collections.deque[Hashable] = collections.deque()
        self.waiting = 0  # tickets queued (a plain int: the engine thread reads it while the loop changes it)

    def join(self, key: Hashable, ticket: object) -> None:
        tickets = self._queues.get(key)
        if tickets is None:
            tickets = self._queues[key] = collections.deque()
            self._ring.append(key)
        tickets.append(ticket)
        self.waiting += 1

    def head(self) -> object | None:
        """The ticket whose turn it is (None when nobody waits)."""
        if not self._ring:
            return None
        return self._queues[self._ring[0]][0]

    def leave(self, key: Hashable, ticket: object) -> None:
        """``ticket`` started (or gave up): its key's next ticket waits for every other key's turn."""
        tickets = self._queues[key]
        was_head = bool(self._ring) and self._ring[0] == key and tickets[0] is ticket
        tickets.remove(ticket)
        self.waiting -= 1
        if not tickets:
            del self._queues[key]
            self._ring.remove(key)
        elif was_head:
            self._ring.rotate(-1)
