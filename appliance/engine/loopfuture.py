"""``asyncio.wrap_future`` through the engine's wake-up batches (:mod:`appliance.engine.wakeups`): a job's result
reaches the loop in the wake-up that carries the callbacks its job queued, after them."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from typing import Any

from appliance.engine.wakeups import call_soon


def loop_future(source: concurrent.futures.Future[Any],
                loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Future[Any]:
    """A future of ``loop`` (the running one by default) that ends as ``source`` does, delivered with the callbacks
    of the job that ends ``source`` (:func:`batch`); cancelling it cancels ``source`` (a job still queued is
    skipped)."""
    target = (loop or asyncio.get_running_loop()).create_future()
    target_loop = target.get_loop()

    def cancel_source(done: asyncio.Future[Any]) -> None:
        if done.cancelled():
            source.cancel()

    def source_done(done: concurrent.futures.Future[Any]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for the result
            call_soon(target_loop, copy_state, done, target)

    target.add_done_callback(cancel_source)
    source.add_done_callback(source_done)
    return target


def copy_state(source: concurrent.futures.Future[Any], target: asyncio.Future[Any]) -> None:
    """On the loop: ``source``'s end (result, exception or cancellation) becomes ``target``'s, unless ``target``
    ended first (it was cancelled)."""
    if target.done():
        return
    if source.cancelled():
        target.cancel()
        return
    error = source.exception()
    if error is not None:
        target.set_exception(error)
    else:
        target.set_result(source.result())
