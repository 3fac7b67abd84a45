"""The order in which a model's waiting requests start: round-robin over their queue keys (a connection, an
agent), first come first served within a key. Pure.

A model's live context has ``live_slots`` sequences; when they are all busy, the requests that want one wait here,
and a new request that finds others waiting queues behind them. Only the requests at the front of that order try to
start (:meth:`Admission.turn`: as many as there are free sequences, at least the :meth:`Admission.head`), so a
client with 64 requests queued waits its turn like everyone else: the next sequence freed goes to the next key in
the ring, not to the oldest request overall. Several free sequences (a grown pool swapped in) let as many requests
try at once, so that they start before the same step and their prompts are evaluated together, not one per step.

A request refused for want of KV cells while a sequence was free (:class:`ShortOfCells`) records the cells it needs
and those of the requests in flight (:meth:`Admission.short_of_cells`). :attr:`Admission.waiting_cells` is what the
queue adds to the pool's demand: the recorded needs, and for each ticket that has not tried yet (it waits its turn
behind those that try) the mean of the recorded ones; :attr:`Admission.demand` adds the requests in
flight at the last refusal. With nobody waiting both are 0.
"""

from __future__ import annotations

import collections
from collections.abc import Hashable
from dataclasses import dataclass


@dataclass(frozen=True)
class ShortOfCells:
    """A start refused because the requests in flight hold the cells it needs (a sequence was free): ``need`` is its
    own need in cells, ``in_flight`` what the requests in flight need together."""

    need: int
    in_flight: int


@dataclass(frozen=True)
class ShortOfStreams:
    """A start that waits because every KV stream of a split context with fewer streams than ``live_slots`` is busy:
    ``in_flight`` requests hold them."""

    in_flight: int


class Admission:
    """Tickets waiting to start, one FIFO per key, keys served in turn."""

    def __init__(self) -> None:
        self._queues: dict[Hashable, collections.deque[object]] = {}
        self._ring: collections.deque[Hashable] = collections.deque()
        self.waiting = 0  # tickets queued (a plain int: the engine thread reads it while the loop changes it)
        self._cells: dict[object, int] = {}  # ticket -> the cells it needs, for those refused for want of cells
        self._in_flight = 0  # the cells the requests in flight needed at the last refusal for want of cells

    def join(self, key: Hashable, ticket: object) -> None:
        tickets = self._queues.get(key)
        if tickets is None:
            tickets = self._queues[key] = collections.deque()
            self._ring.append(key)
        tickets.append(ticket)
        self.waiting += 1

    def short_of_cells(self, ticket: object, cells: int, in_flight: int) -> None:
        """The queued ``ticket`` was refused for want of ``cells`` KV cells while the requests in flight needed
        ``in_flight``."""
        if ticket not in self._ticket_keys():
            raise ValueError("short_of_cells of a ticket that is not queued")
        if cells < 0 or in_flight < 0:
            raise ValueError(f"cells and in_flight must be at least 0, got {cells} and {in_flight}")
        self._cells[ticket] = cells
        self._in_flight = in_flight

    def cells_of(self, ticket: object) -> int:
        """The cells ``ticket`` was last refused for (0: none recorded)."""
        return self._cells.get(ticket, 0)

    @property
    def waiting_cells(self) -> int:
        """The cells the queued tickets need together: the recorded needs, a ticket without one counted as their
        mean (0 when none is recorded)."""
        if not self._cells:
            return 0
        recorded = sum(self._cells.values())
        return recorded + (self.waiting - len(self._cells)) * recorded // len(self._cells)

    @property
    def demand(self) -> int:
        """The cells the requests in flight (at the last refusal) and the queued ones need together; 0 when no
        queued ticket was refused for want of cells."""
        if not self._cells:
            return 0
        return self._in_flight + self.waiting_cells

    def _ticket_keys(self) -> list[object]:
        return [ticket for tickets in self._queues.values() for ticket in tickets]

    def head(self) -> object | None:
        """The ticket whose turn it is (None when nobody waits)."""
        if not self._ring:
            return None
        return self._queues[self._ring[0]][0]

    def turn(self, count: int) -> list[object]:
        """The first ``count`` tickets (at least one) in the order they start: round-robin over the keys from the
        head's, first come first served within a key."""
        order: list[object] = []
        depth = 0
        wanted = max(1, count)
        while len(order) < wanted:
            layer = [self._queues[key][depth] for key in self._ring if len(self._queues[key]) > depth]
            if not layer:
                break
            order.extend(layer)
            depth += 1
        return order[:wanted]

    def leave(self, key: Hashable, ticket: object) -> None:
        """``ticket`` started (or gave up): its key's next ticket waits for every other key's turn."""
        tickets = self._queues[key]
        was_head = bool(self._ring) and self._ring[0] == key and tickets[0] is ticket
        tickets.remove(ticket)
        self._cells.pop(ticket, None)
        self.waiting -= 1
        if not self._cells:
            self._in_flight = 0
        if not tickets:
            del self._queues[key]
            self._ring.remove(key)
        elif was_head:
            self._ring.rotate(-1)
