"""Loop wake-ups from the engine thread (appliance.engine.wakeups) and the worker's jobs that batch them: a real
event loop in this thread, a real FairWorker thread; the loop counts its ``call_soon_threadsafe`` calls."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any

import pytest
from counting_loop import CountingLoop

from appliance.engine import loopfuture, wakeups
from appliance.engine.worker import FairWorker, jobs_waiting, others_waiting


@pytest.fixture
def loop() -> Any:
    loop = CountingLoop()
    yield loop
    loop.close()


@pytest.fixture
def worker() -> Any:
    w = FairWorker("test-wakeups")
    yield w
    w.close()


def test_a_jobs_calls_and_its_result_wake_the_loop_once_in_order(loop: CountingLoop, worker: FairWorker) -> None:
    seen: list[str] = []

    def job() -> str:
        for name in ("a", "b", "c"):
            wakeups.call_soon(loop, seen.append, name)
        return "result"

    def mark_done(_: asyncio.Future[str]) -> None:
        seen.append("done")

    async def main() -> str:
        future = loopfuture.loop_future(worker.submit(job))
        future.add_done_callback(mark_done)
        return await future

    assert loop.run_until_complete(main()) == "result"
    assert seen == ["a", "b", "c", "done"]  # the job's calls first, then its result
    assert loop.wakeups == 1


def test_outside_a_job_call_soon_wakes_the_loop_at_once(loop: CountingLoop) -> None:
    seen: list[int] = []
    done = threading.Event()

    def other_thread() -> None:
        wakeups.call_soon(loop, seen.append, 1)
        wakeups.call_soon(loop, seen.append, 2)
        done.set()

    async def main() -> None:
        thread = threading.Thread(target=other_thread)
        thread.start()
        while len(seen) < 2:
            await asyncio.sleep(0.001)
        thread.join()  # the calls may run before the thread sets ``done``: wait for it, not for a race

    loop.run_until_complete(main())
    assert done.is_set() and seen == [1, 2]
    assert loop.wakeups >= 2  # one each (asyncio.sleep's timers need none)


def test_a_failing_callback_is_reported_and_the_others_still_run(loop: CountingLoop, worker: FairWorker) -> None:
    seen: list[str] = []
    reported: list[dict[str, Any]] = []

    def record(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        reported.append(context)

    loop.set_exception_handler(record)

    def boom() -> None:
        raise ValueError("boom")

    def job() -> None:
        wakeups.call_soon(loop, boom)
        wakeups.call_soon(loop, seen.append, "after")

    loop.run_until_complete(loopfuture.loop_future(worker.submit(job), loop))
    assert seen == ["after"]
    assert len(reported) == 1 and isinstance(reported[0]["exception"], ValueError)


def test_an_exception_of_the_job_reaches_the_awaiter(loop: CountingLoop, worker: FairWorker) -> None:
    def job() -> None:
        raise KeyError("nope")

    with pytest.raises(KeyError):
        loop.run_until_complete(loopfuture.loop_future(worker.submit(job), loop))


def test_cancelling_the_loop_future_skips_a_queued_job(loop: CountingLoop, worker: FairWorker) -> None:
    gate = threading.Event()
    ran: list[str] = []
    blocker = worker.submit(gate.wait)

    def never() -> None:
        ran.append("x")

    def after() -> str:
        return "after"

    async def main() -> str:
        queued = loopfuture.loop_future(worker.submit(never))
        queued.cancel()
        gate.set()
        await loopfuture.loop_future(blocker)
        return await loopfuture.loop_future(worker.submit(after))  # the worker went past it

    assert loop.run_until_complete(main()) == "after"
    assert ran == []


def test_a_closed_loop_drops_the_calls_without_hurting_the_worker(worker: FairWorker) -> None:
    closed = CountingLoop()
    closed.close()

    def job() -> str:
        wakeups.call_soon(closed, print, "never")
        return "ok"

    future: concurrent.futures.Future[Any] = worker.submit(job)
    assert future.result(timeout=10) == "ok"
    assert worker.submit(job).result(timeout=10) == "ok"  # the worker goes on


def test_jobs_waiting_is_the_queue_behind_the_running_job(worker: FairWorker) -> None:
    assert jobs_waiting() is None  # not a worker's thread
    gate = threading.Event()

    def held() -> int | None:  # reads it while the second job waits
        gate.wait(10)
        return jobs_waiting()

    first = worker.submit(held)
    second = worker.submit(jobs_waiting, queue="other")
    gate.set()
    assert first.result(timeout=10) == 1
    assert second.result(timeout=10) == 0


def test_others_waiting_counts_only_other_keys_jobs(worker: FairWorker) -> None:
    assert others_waiting() is None  # not a worker's thread
    queued = threading.Event()
    read = threading.Event()
    other = threading.Event()
    seen: list[bool | None] = []

    def held() -> None:  # reads it with only its own key's next job queued, then with another key's too
        queued.wait(10)
        seen.append(others_waiting())
        read.set()
        other.wait(10)
        seen.append(others_waiting())

    first = worker.submit(held, queue="steps")
    worker.submit(held, queue="steps")
    queued.set()
    assert read.wait(10)
    worker.submit(others_waiting, queue="start")
    other.set()
    first.result(timeout=10)
    assert seen[:2] == [False, True]


def test_flush_hands_over_now_and_goes_on_batching(loop: CountingLoop, worker: FairWorker) -> None:
    seen: list[str] = []

    def job() -> int:
        wakeups.call_soon(loop, seen.append, "first step")
        wakeups.flush()
        wakeups.call_soon(loop, seen.append, "second step")
        wakeups.call_soon(loop, seen.append, "its end")
        return loop.wakeups

    async def scenario() -> int:
        return await loopfuture.loop_future(worker.submit(job))

    at_flush = loop.run_until_complete(scenario())
    assert at_flush == 1 and loop.wakeups == 2  # one at the flush, one for the rest and the result
    assert seen == ["first step", "second step", "its end"]
