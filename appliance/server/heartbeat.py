"""Which requests of a connection owe a HEARTBEAT, and when the next one is due (pure arithmetic).

A request in flight gets a HEARTBEAT once nothing was sent for it (no token, no heartbeat) for the heartbeat
interval. Most requests end long before their first beat is due, so a connection does not arm a timer per request:
it keeps one timer for all its requests, armed when a request starts and none is armed, and at each firing asks
:func:`beats_due` which requests beat now and when to fire next (none: the timer is not re-armed). A connection
answering one short request after another thus arms one timer per heartbeat interval, not one per request.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class BeatPlan:
    """What one firing of a connection's heartbeat timer does: beat ``now`` (the ``task_id`` of each request that
    owes one), then fire again at ``next_at`` (None: no request in flight, the timer stays unarmed)."""

    now: tuple[str, ...]
    next_at: float | None


def beats_due(last_sent: Mapping[str, float], at: float, interval_s: float) -> BeatPlan:
    """The plan at time ``at`` for the requests in flight, ``last_sent`` (``task_id`` -> when the last message for
    it was sent, or when it started): those whose last message is ``interval_s`` old or older beat now (their
    last message is then the beat, at ``at``); the timer fires next when the oldest of them all comes due."""
    if interval_s <= 0:
        raise ValueError("interval_s must be > 0")
    beating: list[str] = []
    oldest: float | None = None
    for task_id, last in last_sent.items():
        if at - last >= interval_s:
            beating.append(task_id)
            last = at
        oldest = last if oldest is None else min(oldest, last)
    return BeatPlan(tuple(beating), None if oldest is None else oldest + interval_s)
