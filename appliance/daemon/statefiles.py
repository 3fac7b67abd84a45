"""State files whose writes must never fail their caller (the registry file, C4).

A write that hits a full, read-only or otherwise unwritable state folder (any :class:`OSError`: ``ENOSPC``,
``EROFS``, ``EACCES``, ``EDQUOT``…) does not raise: :class:`StateFiles` records a :class:`StateProblem` (health
and STATUS say ``degraded`` with it), logs one warning, and retries with :func:`retry_delay_s` backoff, writing
what the file should hold at the time of the retry. The first write that succeeds clears the problem and logs
the recovery. Every write goes through :func:`write_atomically`: a reader sees the old file or the new one, and a
write that fails half-way leaves neither a temporary file nor a changed file behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger(__name__)

FIRST_RETRY_S = 0.5
"""Seconds before the first retry of a failed state write."""
MAX_RETRY_S = 10.0
"""The longest wait between two retries: a folder that has room again is written within this."""
_MAX_DOUBLINGS = 32  # 2**32 * FIRST_RETRY_S is far past any cap: stop doubling before floats overflow


def retry_delay_s(failures: int, *, first_s: float = FIRST_RETRY_S, max_s: float = MAX_RETRY_S) -> float:
    """Seconds to wait after the ``failures``-th failed write in a row: ``first_s``, doubling, at most ``max_s``."""
    if failures < 1:
        raise ValueError(f"a retry follows at least one failure, not {failures}")
    return min(max_s, first_s * 2.0 ** min(failures - 1, _MAX_DOUBLINGS))


def write_all(fd: int, data: bytes) -> None:
    """Write all of ``data`` to the file descriptor ``fd`` (``os.write`` may write less than asked)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def write_atomically(target: Path, data: bytes) -> None:
    """Write ``data`` to ``target`` through a temporary sibling renamed over it. On any failure the temporary file
    is removed and ``target`` is as it was; the error is raised."""
    # named .<name>.XXXX.tmp, never *.json: a listing of the folder's results skips it
    fd, temporary = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        try:
            write_all(fd, data)
        finally:
            os.close(fd)
        os.replace(temporary, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


@dataclass(frozen=True)
class StateProblem:
    """A state file that cannot be written now: since when, the last error, and when the next retry runs."""

    file: str
    errno: str  # the error's name: ENOSPC, EROFS, EACCES, EDQUOT…
    message: str
    since: float  # wall-clock time of the first failure in a row
    failures: int
    next_retry_at: float  # wall-clock time of the next retry

    @property
    def reason(self) -> str:
        return f"cannot write the state file {self.file}: {self.message} ({self.errno}); retrying"

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "errno": self.errno, "message": self.message, "since": self.since,
                "failures": self.failures, "next_retry_at": self.next_retry_at, "reason": self.reason}


def error_name(exc: OSError) -> str:
    """``ENOSPC`` for a full disk; ``OSError`` when the error carries no errno."""
    if exc.errno is None:
        return type(exc).__name__
    return errno.errorcode.get(exc.errno, str(exc.errno))


class Cancellable(Protocol):
    def cancel(self) -> None: ...


Scheduler = Callable[[float, Callable[[], None]], Cancellable]
"""Runs a callback after a delay in seconds (the event loop's ``call_later``); returns what cancels it."""
Writer = Callable[[Path, bytes], None]
"""Writes bytes to a file, raising :class:`OSError` when it cannot (:func:`write_atomically`)."""


def later_on_running_loop(delay_s: float, callback: Callable[[], None]) -> Cancellable:
    """The default :data:`Scheduler`: ``call_later`` on the running event loop (writes are made on the loop)."""
    return asyncio.get_running_loop().call_later(delay_s, callback)


class _NotScheduled:
    """The retry of a write that failed after :meth:`StateFiles.close`: there is none."""

    def cancel(self) -> None:
        return None


_NOT_SCHEDULED = _NotScheduled()


@dataclass
class _Failing:
    """A file whose last write failed: what to write at the retry, and the problem shown meanwhile."""

    produce: Callable[[], bytes]
    problem: StateProblem
    retry: Cancellable
    retries: int = 0  # scheduled retries that failed: the backoff's count (a caller's own writes do not add)


class StateFiles:
    """The state files' writer: :meth:`write` never raises :class:`OSError`; :meth:`problems` says what cannot be
    written now (module docstring)."""

    def __init__(self, *, schedule: Scheduler = later_on_running_loop, writer: Writer = write_atomically,
                 clock: Callable[[], float] = time.time, first_retry_s: float = FIRST_RETRY_S,
                 max_retry_s: float = MAX_RETRY_S) -> None:
        self._schedule = schedule
        self._writer = writer
        self._clock = clock
        self.first_retry_s = first_retry_s
        self.max_retry_s = max_retry_s
        self._failing: dict[Path, _Failing] = {}
        self.closed = False

    def write(self, file: Path, produce: Callable[[], bytes]) -> bool:
        """Write ``produce()`` to ``file`` now; True if it was written. When the write fails the file's problem is
        recorded and a retry scheduled (it calls ``produce`` again, so it writes the state of its own time); False.
        Only the write's :class:`OSError` is handled: an error of ``produce`` is a bug and raises."""
        data = produce()
        try:
            self._writer(file, data)
        except OSError as exc:
            self._failed(file, produce, exc)
            return False
        self._succeeded(file)
        return True

    def problems(self) -> list[StateProblem]:
        """The files that cannot be written now, the longest-failing first."""
        return sorted((failing.problem for failing in self._failing.values()), key=_since)

    def report(self) -> dict[str, Any]:
        """One STATUS record: ``status=ok``, or ``degraded`` with the count and the first problem's fields."""
        problems = self.problems()
        if not problems:
            return {"status": "ok"}
        first = problems[0]
        return {"status": "degraded", "problems": len(problems), "file": first.file, "errno": first.errno,
                "message": first.message, "since": first.since, "failures": first.failures}

    def close(self) -> None:
        """Cancel the pending retries (the appliance stops): nothing is written after this returns."""
        self.closed = True
        for failing in self._failing.values():
            failing.retry.cancel()

    def _failed(self, file: Path, produce: Callable[[], bytes], exc: OSError) -> None:
        name = error_name(exc)
        message = exc.strerror or str(exc)
        failing = self._failing.get(file)
        if failing is None:
            delay = retry_delay_s(1, first_s=self.first_retry_s, max_s=self.max_retry_s)
            now = self._clock()
            problem = StateProblem(str(file), name, message, now, 1, now + delay)
            log.warning("%s (requests are served meanwhile; the wait between retries grows to %g s)", problem.reason,
                        self.max_retry_s)
            self._failing[file] = _Failing(produce, problem, self._later(delay, file))
            return
        previous = failing.problem
        if previous.errno != name:
            log.warning("still cannot write the state file %s, now: %s (%s)", file, message, name)
        failing.produce = produce
        failing.problem = replace(previous, errno=name, message=message, failures=previous.failures + 1)

    def _retry(self, file: Path) -> None:
        failing = self._failing.get(file)
        if failing is None or self.closed:
            return
        if self.write(file, failing.produce):
            return
        failing.retries += 1
        delay = retry_delay_s(failing.retries + 1, first_s=self.first_retry_s, max_s=self.max_retry_s)
        failing.problem = replace(failing.problem, next_retry_at=self._clock() + delay)  # the write counted the failure
        failing.retry = self._later(delay, file)

    def _later(self, delay_s: float, file: Path) -> Cancellable:
        if self.closed:
            return _NOT_SCHEDULED

        def retry() -> None:
            self._retry(file)

        return self._schedule(delay_s, retry)

    def _succeeded(self, file: Path) -> None:
        failing = self._failing.pop(file, None)
        if failing is None:
            return
        failing.retry.cancel()
        problem = failing.problem
        log.info("the state file %s is written again, after %d failed write(s) over %.1f s", file, problem.failures,
                 self._clock() - problem.since)


def _since(problem: StateProblem) -> float:
    return problem.since
