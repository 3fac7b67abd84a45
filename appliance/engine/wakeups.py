"""Event-loop wake-ups from the engine thread: one per engine job, however much it hands over.

A step of a model gives every generating sequence a token, may end some requests, and has a result of its own;
each of those is a callback for the event loop, and each ``loop.call_soon_threadsafe`` wakes the loop (a byte
through its self-pipe, a ``select``, a loop iteration: tens of microseconds on a small box). While a thread runs an
engine job inside :func:`batch`, :func:`call_soon` queues the callbacks instead, and the batch hands them to each
loop in ONE ``call_soon_threadsafe`` when the job ends, in the order they were queued. Outside a batch (a thread
that runs no engine job) :func:`call_soon` is ``call_soon_threadsafe`` itself.

:func:`appliance.engine.loopfuture.loop_future` is ``asyncio.wrap_future`` whose result goes through the same batch.
This module names no asyncio (the engine worker, a pure module, uses it): a loop is anything with
``call_soon_threadsafe`` and ``call_exception_handler``.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

Call = tuple[Callable[..., object], tuple[Any, ...]]


class Loop(Protocol):
    """What a wake-up needs of an event loop."""

    def call_soon_threadsafe(self, callback: Callable[..., object], *args: Any) -> Any: ...

    def call_exception_handler(self, context: dict[str, Any]) -> None: ...

_batches = threading.local()


def call_soon(loop: Loop, callback: Callable[..., object], *args: Any) -> None:
    """Call ``callback(*args)`` on ``loop``: with the others of the running job (:func:`batch`), or at once.
    Outside a batch a closed loop raises ``RuntimeError`` (as ``call_soon_threadsafe`` does); in a batch its calls
    are dropped (nobody is left to receive them)."""
    pending: list[tuple[Loop, Call]] | None = getattr(_batches, "pending", None)
    if pending is None:
        loop.call_soon_threadsafe(callback, *args)
        return
    pending.append((loop, (callback, args)))


@contextlib.contextmanager
def batch() -> Iterator[None]:
    """Hold the :func:`call_soon` calls this thread makes until the block ends, then wake each loop once for all of
    them. A batch inside a batch is the outer one."""
    if getattr(_batches, "pending", None) is not None:
        yield
        return
    pending: list[tuple[Loop, Call]] = []
    _batches.pending = pending
    try:
        yield
    finally:
        _batches.pending = None
        hand_over(pending)


def flush() -> None:
    """Inside a batch: hand over the calls queued so far now (one wake-up per loop), and go on batching the next
    ones (a job that runs several steps wakes the loop once per step, not once at its end). Outside one: nothing."""
    pending: list[tuple[Loop, Call]] | None = getattr(_batches, "pending", None)
    if not pending:
        return
    taken = pending.copy()
    pending.clear()
    hand_over(taken)


def hand_over(pending: list[tuple[Loop, Call]]) -> None:
    """One ``call_soon_threadsafe`` per loop for its calls in ``pending``, in order."""
    by_loop: dict[Loop, list[Call]] = {}
    for loop, call in pending:
        by_loop.setdefault(loop, []).append(call)
    for loop, calls in by_loop.items():
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody can receive them
            loop.call_soon_threadsafe(run_calls, loop, calls)


def run_calls(loop: Loop, calls: list[Call]) -> None:
    """On the loop: every call in order; one that raises is reported as the loop reports a failed callback, and
    the others still run."""
    for callback, args in calls:
        try:
            callback(*args)
        except Exception as exc:
            loop.call_exception_handler({"message": f"exception in callback {callback!r}", "exception": exc})
