"""The two non-message results of a sans-IO reader's ``next_event`` (frames, MAGN connection, line protocol)."""

from __future__ import annotations

import enum


class Sentinel(enum.Enum):
    NEED_DATA = "NEED_DATA"
    CLOSED = "CLOSED"

    def __repr__(self) -> str:
        return self.value


NEED_DATA = Sentinel.NEED_DATA
"""Nothing complete is buffered: call ``receive_data`` with more bytes."""
CLOSED = Sentinel.CLOSED
"""End of stream was signalled and everything received was returned."""
