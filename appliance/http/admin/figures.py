"""The admin page's figures, computed from the daemon's numbers: the ledger bar, idle-TTL countdowns, byte and
time formats, and a ledger denial's figures. Pure: the views read the daemon and hand the numbers in."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

UNITS = ("bytes", "KiB", "MiB", "GiB", "TiB")
MODEL_COLOURS = 6
"""How many colour classes (``seg-model-0`` .. ``seg-model-5`` in web/admin.css) the model segments cycle through."""


def format_bytes(value: int | None) -> str:
    """``1536`` -> ``1.5 KiB``; under 1 KiB exact; None -> an em dash (not known)."""
    if value is None:
        return "\u2014"
    size = float(value)
    for unit in UNITS:
        if abs(size) < 1024 or unit == UNITS[-1]:
            if unit == "bytes":
                return f"{int(size)} bytes"
            return f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def format_seconds(value: float | None) -> str:
    """``0.0123`` -> ``12.3 ms``; ``75`` -> ``1 min 15 s``; None -> an em dash."""
    if value is None:
        return "\u2014"
    if value < 1:
        return f"{value * 1000:.1f} ms"
    if value < 60:
        return f"{value:.1f} s"
    minutes, seconds = divmod(int(value), 60)
    if minutes < 60:
        return f"{minutes} min {seconds} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def format_time(at: float | None) -> str:
    """A wall-clock time (seconds since the epoch) as UTC ``YYYY-MM-DD HH:MM:SS``."""
    if at is None:
        return "\u2014"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)) + " UTC"


def format_clock(at: float) -> str:
    """A wall-clock time (seconds since the epoch) as UTC ``HH:MM:SS`` (a log line's time)."""
    return time.strftime("%H:%M:%S", time.gmtime(at))


@dataclass(frozen=True)
class MemoryNames:
    """What the page calls the memory the ledger admits into: the bar's heading and the memory itself."""

    ledger: str
    memory: str


def memory_names(kind: str) -> MemoryNames:
    """A device kind's names (``DeviceReading.kind``): VRAM on an accelerator (``nvml``; ``fake``, the stand-in for
    one on a box without a GPU), host RAM on ``host``."""
    if kind == "host":
        return MemoryNames("Ledger", "host RAM")
    return MemoryNames("VRAM ledger", "device memory")


@dataclass(frozen=True)
class Segment:
    """One stretch of the ledger bar: ``offset`` and ``width`` are percentages of the bar."""

    label: str
    nbytes: int
    css: str
    offset: float
    width: float


def ledger_bar(total: int, cap: int, reservations: Mapping[str, int], external: int) -> list[Segment]:
    """The device's memory as a bar: each reservation (by model), other processes' use, what is free under the
    cap, and the headroom the cap keeps out (``100 - admission_percent``). When the figures add up to more than
    the device (the ledger over its cap after a resync), the bar is scaled to their sum."""
    allocated = sum(reservations.values())
    free = max(0, cap - allocated)
    parts: list[tuple[str, int, str]] = []
    for index, (key, nbytes) in enumerate(reservations.items()):
        parts.append((key, nbytes, f"seg-model-{index % MODEL_COLOURS}"))
    parts.append(("other processes", external, "seg-external"))
    parts.append(("free under the cap", free, "seg-free"))
    headroom = max(0, total - allocated - external - free)
    parts.append(("headroom (outside the cap)", headroom, "seg-headroom"))
    scale = max(total, allocated + external + free, 1)
    segments = []
    offset = 0.0
    for label, nbytes, css in parts:
        width = 100.0 * nbytes / scale
        segments.append(Segment(label, nbytes, css, round(offset, 3), round(width, 3)))
        offset += width
    return segments


def ttl_left(*, loaded: bool, refcount: int, inflight: int, idle_ttl_s: float, last_used: float,
             now: float) -> float | None:
    """Seconds until the idle sweep may unload a model (L7), or None when no countdown runs: not loaded, held by
    an agent or a request, or a TTL of 0 (never)."""
    if not loaded or refcount > 0 or inflight > 0 or idle_ttl_s <= 0:
        return None
    return max(0.0, idle_ttl_s - (now - last_used))


DENIAL_FIGURES = (("requested", "requested_table_bytes"), ("allocated", "ledger_allocated_bytes"),
                  ("cap", "ledger_max_bytes"))
"""A ``VRAM_LEDGER_DENY``'s figures as the page names them, and their keys in the error's details."""


def denial_figures(details: Mapping[str, Any]) -> list[tuple[str, int]]:
    """``[("requested", n), ("allocated", n), ("cap", n)]`` from a ``VRAM_LEDGER_DENY``'s details (those present)."""
    return [(name, details[key]) for name, key in DENIAL_FIGURES if isinstance(details.get(key), int)]
