"""The engine's fair worker: one thread, one FIFO queue per key, keys served round-robin.

Every llama.cpp call of a device runs on one thread. A plain FIFO pool lets one client that queued 3,000 requests
make everyone else wait behind them; :class:`FairWorker` keeps one queue per *key* (a connection, an agent) and
takes one job from each key with work in turn, so a key's wait depends on how many keys are busy, not on how many
jobs another key queued. Within a key, jobs run in the order submitted.

Jobs are :class:`concurrent.futures.Future` based (no asyncio here): :meth:`FairWorker.submit` returns the job's
future; cancelling it before the job starts skips the job, a job already running is never interrupted. The engine
wraps the future for the event loop (:func:`~appliance.engine.loopfuture.loop_future`). Each job runs in a wake-up
batch (:func:`appliance.engine.wakeups.batch`): whatever it hands to the event loop, its result included, wakes
the loop once, when it ends.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable, Hashable
from typing import Any

from appliance.engine import wakeups

DEFAULT_QUEUE = "engine"
"""The key of jobs submitted without one (loads, unloads, housekeeping)."""

Job = tuple[Callable[[], Any], "concurrent.futures.Future[Any]"]

_serving = threading.local()  # .worker: the FairWorker whose thread this is


def jobs_waiting() -> int | None:
    """On a worker's thread (inside a job): the jobs queued behind the running one; None on any other thread."""
    worker: FairWorker | None = getattr(_serving, "worker", None)
    return None if worker is None else worker.queued


def others_waiting() -> bool | None:
    """On a worker's thread (inside a job): whether a job of another key than the running job's is queued (a job
    that could go on need not make way for its own key's next jobs); None on any other thread."""
    worker: FairWorker | None = getattr(_serving, "worker", None)
    return None if worker is None else worker.others_queued


class FairWorker:
    """One worker thread serving per-key FIFO queues round-robin (one job per key per turn).

    It owns the thread, the queues (``key`` -> jobs not yet started) and the ring of keys with work; a key with no
    job left leaves the ring, and joins it at the end again with its next job. :meth:`close` refuses new jobs,
    cancels the queued ones and waits for the running one."""

    def __init__(self, name: str = "engine", *, on_start: Callable[[], None] | None = None) -> None:
        self._cond = threading.Condition()
        self._queues: dict[Hashable, collections.deque[Job]] = {}
        self._ring: collections.deque[Hashable] = collections.deque()  # keys with queued jobs, next to serve first
        self._running_key: Hashable | None = None  # the key of the job running (or of the last one)
        self._closed = False
        self._on_start = on_start
        self.thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self.thread.start()

    @property
    def queued(self) -> int:
        """Jobs waiting (not counting the one running)."""
        with self._cond:
            return sum(len(jobs) for jobs in self._queues.values())

    @property
    def others_queued(self) -> bool:
        """Whether a job of another key than the running job's waits."""
        with self._cond:
            return any(key != self._running_key for key in self._ring)

    def submit(self, fn: Callable[[], Any], *, queue: Hashable = DEFAULT_QUEUE) -> concurrent.futures.Future[Any]:
        """Queue ``fn`` behind the other jobs of ``queue``; its future gives ``fn``'s value or exception."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the engine worker is closed")
            jobs = self._queues.get(queue)
            if jobs is None:
                jobs = self._queues[queue] = collections.deque()
                self._ring.append(queue)
            jobs.append((fn, future))
            self._cond.notify()
        return future

    def _next(self) -> Job | None:
        """The next job in round-robin order; None once closed and empty."""
        with self._cond:
            while not self._ring:
                if self._closed:
                    return None
                self._cond.wait()
            key = self._ring.popleft()
            self._running_key = key
            jobs = self._queues[key]
            job = jobs.popleft()
            if jobs:
                self._ring.append(key)  # its next job waits for every other key's turn
            else:
                del self._queues[key]
            return job

    def _serve(self) -> None:
        _serving.worker = self
        if self._on_start is not None:
            self._on_start()
        while True:
            job = self._next()
            if job is None:
                return
            fn, future = job
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while queued
            with wakeups.batch():  # what the job hands to the loop, its result last, in one wake-up
                try:
                    result = fn()
                except BaseException as exc:  # delivered to the submitter, never kills the worker
                    future.set_exception(exc)
                else:
                    future.set_result(result)
            del job, fn, future  # drop references before waiting for the next job

    def close(self) -> None:
        """Refuse new jobs, cancel the queued ones, wait for the one running. Safe to call more than once."""
        with self._cond:
            self._closed = True
            dropped = [future for jobs in self._queues.values() for _, future in jobs]
            self._queues.clear()
            self._ring.clear()
            self._cond.notify_all()
        for future in dropped:
            future.cancel()
        if threading.current_thread() is not self.thread:
            self.thread.join()
