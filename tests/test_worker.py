"""The engine's fair worker: keys served round-robin, FIFO within a key, errors delivered, close (no model)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading

import pytest

from appliance.engine.fake import FakeEngine
from appliance.engine.worker import FairWorker

WAIT_S = 10


class Recorder:
    """Jobs that append their name to ``order``; ``blocker`` holds the worker until the test releases it."""

    def __init__(self) -> None:
        self.order: list[str] = []
        self.release = threading.Event()
        self.started = threading.Event()

    def block(self) -> str:
        self.started.set()
        assert self.release.wait(WAIT_S)
        return "blocker"

    def job(self, name: str) -> str:
        self.order.append(name)
        return name


@pytest.fixture
def worker():  # type: ignore[no-untyped-def]
    w = FairWorker("test-worker")
    yield w
    w.close()


def held(worker: FairWorker, rec: Recorder) -> concurrent.futures.Future[str]:
    """Occupy the worker thread, so that everything submitted next is queued before anything runs."""
    future = worker.submit(rec.block, queue="blocker")
    assert rec.started.wait(WAIT_S)
    return future


def test_keys_take_turns_one_job_each(worker: FairWorker) -> None:
    rec = Recorder()
    first = held(worker, rec)
    futures = [worker.submit(functools.partial(rec.job, f"greedy{i}"), queue="greedy") for i in range(5)]
    futures += [worker.submit(functools.partial(rec.job, "polite"), queue="polite")]
    futures += [worker.submit(functools.partial(rec.job, "late"), queue="late")]
    assert worker.queued == 7
    rec.release.set()
    concurrent.futures.wait([first, *futures], WAIT_S)
    # the polite key's single job runs after one greedy job, not after all five
    assert rec.order == ["greedy0", "polite", "late", "greedy1", "greedy2", "greedy3", "greedy4"]
    assert [f.result() for f in futures[:2]] == ["greedy0", "greedy1"]


def test_a_key_that_comes_back_joins_the_end_of_the_ring(worker: FairWorker) -> None:
    rec = Recorder()
    first = held(worker, rec)
    jobs = [("a", "a0"), ("b", "b0"), ("a", "a1"), ("c", "c0"), ("b", "b1"), ("a", "a2")]
    futures = [worker.submit(functools.partial(rec.job, name), queue=key) for key, name in jobs]
    rec.release.set()
    concurrent.futures.wait([first, *futures], WAIT_S)
    assert rec.order == ["a0", "b0", "c0", "a1", "b1", "a2"]


def test_fifo_within_a_key(worker: FairWorker) -> None:
    rec = Recorder()
    first = held(worker, rec)
    futures = [worker.submit(functools.partial(rec.job, str(i)), queue="k") for i in range(50)]
    rec.release.set()
    concurrent.futures.wait([first, *futures], WAIT_S)
    assert rec.order == [str(i) for i in range(50)]


def fail() -> None:
    raise ValueError("boom")


def test_an_exception_is_delivered_and_the_worker_goes_on(worker: FairWorker) -> None:
    bad = worker.submit(fail, queue="k")
    with pytest.raises(ValueError, match="boom"):
        bad.result(WAIT_S)
    assert worker.submit(functools.partial(int, "7"), queue="k").result(WAIT_S) == 7


def test_a_job_cancelled_while_queued_is_skipped(worker: FairWorker) -> None:
    rec = Recorder()
    first = held(worker, rec)
    skipped = worker.submit(functools.partial(rec.job, "skipped"), queue="k")
    kept = worker.submit(functools.partial(rec.job, "kept"), queue="k")
    assert skipped.cancel()
    rec.release.set()
    assert kept.result(WAIT_S) == "kept"
    assert first.result(WAIT_S) == "blocker"
    assert rec.order == ["kept"]


def test_close_waits_for_the_running_job_cancels_the_queued_and_refuses_new_ones() -> None:
    worker = FairWorker("closing")
    rec = Recorder()
    first = held(worker, rec)
    queued = worker.submit(functools.partial(rec.job, "never"), queue="k")
    closer = threading.Thread(target=worker.close)
    closer.start()
    rec.release.set()
    closer.join(WAIT_S)
    assert not closer.is_alive() and not worker.thread.is_alive()
    assert first.result(0) == "blocker"
    assert queued.cancelled() and rec.order == []
    with pytest.raises(RuntimeError):
        worker.submit(functools.partial(rec.job, "x"))
    worker.close()  # twice is fine


def test_the_fake_engine_serves_keys_round_robin_for_the_loop() -> None:
    engine = FakeEngine()
    rec = Recorder()

    async def scenario() -> list[str]:
        first = engine.submit(rec.block, queue="blocker")
        await asyncio.to_thread(rec.started.wait, WAIT_S)
        greedy = [engine.call(rec.job, f"greedy{i}", queue="greedy") for i in range(3)]
        polite = engine.call(rec.job, "polite", queue="polite")
        tasks = [asyncio.ensure_future(c) for c in [*greedy, polite]]
        await asyncio.sleep(0)  # the coroutines submit their jobs
        rec.release.set()
        await first
        return list(await asyncio.gather(*tasks))

    try:
        results = asyncio.run(scenario())
    finally:
        engine.close()
    assert results == ["greedy0", "greedy1", "greedy2", "polite"]
    assert rec.order == ["greedy0", "polite", "greedy1", "greedy2"]
