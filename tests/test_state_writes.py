"""State writes that must not fail their caller (appliance/daemon/statefiles.py): the backoff, the atomic write's
clean-up, and :class:`StateFiles` with an injected failing writer, a fake scheduler and a fake clock."""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from appliance.daemon import statefiles
from appliance.daemon.statefiles import StateFiles, retry_delay_s, write_atomically

FILE = Path("/state/registry.json")


# -- the backoff ------------------------------------------------------------------------------------------------------


def test_the_retry_delay_doubles_from_the_first_up_to_the_cap() -> None:
    delays = [retry_delay_s(failures, first_s=0.5, max_s=10.0) for failures in range(1, 9)]
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]


def test_the_retry_delay_stays_at_the_cap_after_any_number_of_failures() -> None:
    assert retry_delay_s(10**6, first_s=0.5, max_s=10.0) == 10.0


def test_a_retry_delay_needs_a_failure() -> None:
    with pytest.raises(ValueError, match="at least one failure"):
        retry_delay_s(0)


# -- the atomic write -------------------------------------------------------------------------------------------------


def half_then_full(fd: int, data: bytes) -> None:
    """An os-level write on a disk that fills up: some bytes reach the file, then ENOSPC."""
    os.write(fd, bytes(data[:2]))
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_an_atomic_write_replaces_the_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    target = tmp_path / "registry.json"
    target.write_bytes(b"old")
    write_atomically(target, b"new")
    assert target.read_bytes() == b"new"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["registry.json"]


def test_a_write_that_fails_half_way_removes_its_temporary_and_keeps_the_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "registry.json"
    target.write_bytes(b"old")
    monkeypatch.setattr(statefiles, "write_all", half_then_full)
    with pytest.raises(OSError) as raised:
        write_atomically(target, b"new contents")
    assert raised.value.errno == errno.ENOSPC
    assert target.read_bytes() == b"old"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["registry.json"]


def test_an_atomic_write_into_a_missing_folder_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        write_atomically(tmp_path / "gone" / "registry.json", b"x")


# -- StateFiles -------------------------------------------------------------------------------------------------------


@dataclass
class Timer:
    delay_s: float
    callback: Callable[[], None]
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


@dataclass
class FakeLoop:
    """A scheduler and a clock: :meth:`run_next` advances the clock to the next pending timer and runs it."""

    now: float = 1000.0
    timers: list[Timer] = field(default_factory=list)

    def clock(self) -> float:
        return self.now

    def call_later(self, delay_s: float, callback: Callable[[], None]) -> Timer:
        timer = Timer(delay_s, callback)
        self.timers.append(timer)
        return timer

    def pending(self) -> list[Timer]:
        return [timer for timer in self.timers if not timer.cancelled]

    def run_next(self) -> float:
        [timer] = self.pending()  # a file has at most one retry waiting
        self.timers.remove(timer)
        self.now += timer.delay_s
        timer.callback()
        return timer.delay_s


@dataclass
class FlakyDisk:
    """A writer that raises the errnos of ``errors`` one call each, then writes."""

    errors: list[int]
    files: dict[Path, bytes] = field(default_factory=dict)
    calls: int = 0

    def __call__(self, file: Path, data: bytes) -> None:
        self.calls += 1
        if self.errors:
            code = self.errors.pop(0)
            raise OSError(code, os.strerror(code), str(file))
        self.files[file] = data


@dataclass
class Counter:
    """What the file should hold now: a new value each time it is asked."""

    value: int = 0

    def produce(self) -> bytes:
        self.value += 1
        return str(self.value).encode()


def state_files(disk: FlakyDisk, loop: FakeLoop) -> StateFiles:
    return StateFiles(schedule=loop.call_later, writer=disk, clock=loop.clock, first_retry_s=0.5, max_retry_s=4.0)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]


def test_a_write_that_succeeds_records_nothing() -> None:
    disk, loop = FlakyDisk([]), FakeLoop()
    files = state_files(disk, loop)
    assert files.write(FILE, Counter().produce) is True
    assert disk.files[FILE] == b"1"
    assert files.problems() == [] and loop.pending() == []
    assert files.report() == {"status": "ok"}


def test_a_full_disk_is_a_problem_with_one_warning_and_retries_with_backoff_until_written(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="appliance.daemon.statefiles")
    disk, loop = FlakyDisk([errno.ENOSPC] * 6), FakeLoop()
    files = state_files(disk, loop)
    state = Counter()
    assert files.write(FILE, state.produce) is False  # never raises
    [problem] = files.problems()
    assert (problem.file, problem.errno, problem.message) == (str(FILE), "ENOSPC", os.strerror(errno.ENOSPC))
    assert problem.since == 1000.0 and problem.failures == 1 and problem.next_retry_at == 1000.5
    assert str(FILE) in problem.reason and "ENOSPC" in problem.reason
    assert files.write(FILE, state.produce) is False  # a second change while the disk is full: no second timer
    assert len(loop.pending()) == 1
    delays = [loop.run_next() for _ in range(4)]
    assert delays == [0.5, 1.0, 2.0, 4.0]
    [problem] = files.problems()
    assert problem.failures == 6 and problem.since == 1000.0
    assert problem.next_retry_at == 1000.0 + 0.5 + 1 + 2 + 4 + 4
    assert files.report() == {"status": "degraded", "problems": 1, "file": str(FILE), "errno": "ENOSPC",
                              "message": os.strerror(errno.ENOSPC), "since": 1000.0, "failures": 6}
    assert len(warnings_of(caplog)) == 1, warnings_of(caplog)
    assert FILE not in disk.files
    assert loop.run_next() == 4.0  # capped; the disk has room again: this retry writes
    assert files.problems() == [] and loop.pending() == []
    assert disk.files[FILE] == str(state.value).encode(), "the retry writes the state of its own time"
    assert state.value == 7
    recovery = [record.getMessage() for record in caplog.records if "written again" in record.getMessage()]
    assert recovery == [f"the state file {FILE} is written again, after 6 failed write(s) over 11.5 s"]


def test_a_write_that_succeeds_while_a_retry_waits_cancels_the_retry() -> None:
    disk, loop = FlakyDisk([errno.ENOSPC]), FakeLoop()
    files = state_files(disk, loop)
    assert files.write(FILE, Counter().produce) is False
    [timer] = loop.pending()
    assert files.write(FILE, Counter().produce) is True
    assert timer.cancelled and files.problems() == []


def test_a_new_error_on_the_same_file_is_logged_and_shown(caplog: pytest.LogCaptureFixture) -> None:
    disk, loop = FlakyDisk([errno.ENOSPC, errno.ENOSPC, errno.EROFS]), FakeLoop()
    files = state_files(disk, loop)
    for _ in range(3):
        files.write(FILE, Counter().produce)
    [problem] = files.problems()
    assert problem.errno == "EROFS" and problem.failures == 3 and problem.since == 1000.0
    assert len(warnings_of(caplog)) == 2, warnings_of(caplog)
    assert "EROFS" in warnings_of(caplog)[1]


def test_each_file_has_its_own_problem_the_longest_failing_first() -> None:
    disk, loop = FlakyDisk([errno.ENOSPC, errno.EACCES]), FakeLoop()
    files = state_files(disk, loop)
    other = Path("/state/results.json")
    files.write(FILE, Counter().produce)
    loop.now += 1
    files.write(other, Counter().produce)
    assert [(p.file, p.errno) for p in files.problems()] == [(str(FILE), "ENOSPC"), (str(other), "EACCES")]
    assert files.report()["problems"] == 2
    assert files.write(other, Counter().produce) is True
    assert [p.file for p in files.problems()] == [str(FILE)]


def test_close_cancels_the_retries_and_schedules_no_more() -> None:
    disk, loop = FlakyDisk([errno.ENOSPC, errno.ENOSPC]), FakeLoop()
    files = state_files(disk, loop)
    files.write(FILE, Counter().produce)
    [timer] = loop.pending()
    files.close()
    assert timer.cancelled
    timer.callback()  # a timer that fired as it was cancelled writes nothing
    assert disk.calls == 1
    files.write(Path("/state/other.json"), Counter().produce)
    assert loop.pending() == []


def test_an_error_of_what_is_written_is_a_bug_and_raises() -> None:
    files = state_files(FlakyDisk([]), FakeLoop())

    def broken() -> bytes:
        raise TypeError("not JSON serialisable")

    with pytest.raises(TypeError):
        files.write(FILE, broken)
    assert files.problems() == []


def test_the_default_writer_on_a_real_folder_records_a_missing_folder(tmp_path: Path) -> None:
    loop = FakeLoop()
    files = StateFiles(schedule=loop.call_later, clock=loop.clock)
    target = tmp_path / "gone" / "registry.json"
    assert files.write(target, Counter().produce) is False
    [problem] = files.problems()
    assert problem.errno == "ENOENT" and problem.file == str(target)
    (tmp_path / "gone").mkdir()
    loop.run_next()
    assert target.read_bytes() == b"2" and files.problems() == []


def test_a_benchmark_result_that_cannot_be_saved_leaves_no_partial_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.benchmark import runner

    folder = tmp_path / "benchmarks"
    monkeypatch.setattr(statefiles, "write_all", half_then_full)
    with pytest.raises(OSError):
        runner.save({"headline": "x" * 10_000}, folder / "appliance-benchmark-1.json")
    assert list(folder.iterdir()) == []
    monkeypatch.undo()
    runner.save({"headline": "ok"}, folder / "appliance-benchmark-1.json")
    assert [path.name for path in folder.iterdir()] == ["appliance-benchmark-1.json"]
