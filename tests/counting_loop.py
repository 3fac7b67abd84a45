"""An event loop that counts its wake-ups from other threads (the engine's hand-overs: tests/test_wakeups.py,
tests/test_hops.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class CountingLoop(asyncio.SelectorEventLoop):
    """A real selector loop that counts the wake-ups other threads ask of it."""

    def __init__(self) -> None:
        super().__init__()
        self.wakeups = 0

    def call_soon_threadsafe(self, callback: Callable[..., object], *args: Any,
                             context: Any = None) -> asyncio.Handle:
        self.wakeups += 1
        return super().call_soon_threadsafe(callback, *args, context=context)
