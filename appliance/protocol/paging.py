"""Pages of a long list (the agents, up to ``max_agents`` of them): STATUS, the admin page's tables and health show
one page and say how many there are, so what they send stays bounded however many agents register. Pure."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from appliance.errors import ApplianceError

T = TypeVar("T")

MAX_OFFSET_DIGITS = 7
"""An offset has at most this many digits: past every agent ``max_agents`` allows (1,000,000), a page is empty."""
STATUS_AGENTS = 100
"""Agents one STATUS reply lists; ``STATUS agents <offset>`` lists the next ones."""
ADMIN_AGENTS = 50
"""Agents one table of the admin page lists (the dashboard's, the registry's), with next / previous links."""
HOLDERS_SHOWN = 10
"""A model's agents the registry's models table names; the rest are counted."""
HEALTH_PARKED_AGENTS = 20
"""Parked agents ``/v1/health`` names; ``host_kv.parked_agents`` counts them all."""


@dataclass(frozen=True)
class Page(Generic[T]):
    """``items``: at most ``size`` of ``total``, from ``offset`` on."""

    items: list[T]
    offset: int
    size: int
    total: int

    @property
    def shown(self) -> int:
        return len(self.items)

    @property
    def next_offset(self) -> int | None:
        """Where the next page starts; None on the last one."""
        end = self.offset + self.size
        return end if end < self.total else None

    @property
    def previous_offset(self) -> int | None:
        """Where the previous page starts; None on the first one."""
        if self.offset <= 0:
            return None
        return max(0, min(self.offset, self.total) - self.size)


def page_of(items: Sequence[T], offset: int, size: int) -> Page[T]:
    """The page of ``items`` from ``offset`` on (empty past the end)."""
    if offset < 0 or size < 1:
        raise ValueError(f"offset must be at least 0 and size at least 1, got {offset} and {size}")
    return Page(list(items[offset:offset + size]), offset, size, len(items))


def parse_offset(text: str | None, name: str = "offset") -> int:
    """An offset as a client wrote it (None or empty: 0); BAD_REQUEST for anything but a few ASCII digits."""
    if not text:
        return 0
    if not text.isascii() or not text.isdigit() or len(text) > MAX_OFFSET_DIGITS:
        raise ApplianceError("BAD_REQUEST", f"{name} must be an integer from 0 with at most {MAX_OFFSET_DIGITS} "
                                            f"digits", {"field": name, "got": text[:32]})
    return int(text)
