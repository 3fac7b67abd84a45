"""A benchmark run started from the admin page: ``appliance benchmark`` as a child process, one at a time.

:class:`BenchmarkJob` starts the CLI with ``--progress lines`` and reads its stderr: each ``PROGRESS <done> <total>
<label>`` line (:func:`parse_progress`, pure) moves the progress; any other line is kept (the last few) to explain a
failure. On exit 0 the result is the JSON file it was told to write (``--out``); otherwise the run failed with the
CLI's ``appliance: <message>`` line. :meth:`BenchmarkJob.stop` (the appliance's shutdown) ends the child: SIGTERM
to its process group (the appliance processes it started too), SIGKILL after :data:`STOP_GRACE_S`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from appliance.benchmark.progress import Step, parse_progress
from appliance.errors import ApplianceError

State = Literal["idle", "running", "finished", "failed"]

TAIL_LINES = 20
"""How many of the child's last stderr lines (not progress lines) a failure shows."""
MAX_TAIL_CHARS = 1000
"""A kept line is cut to this many characters."""
MAX_LINE_BYTES = 64 * 1024
"""A longer stderr line is skipped (and said so in the tail)."""
STOP_GRACE_S = 5.0
"""How long a stopped child gets after SIGTERM before SIGKILL."""
ERROR_PREFIX = "appliance: "
RESULT_PREFIX = "appliance-benchmark-"


def failure_message(tail: Sequence[str], exit_code: int | None) -> str:
    """Why a run failed, in one line: the CLI's last ``appliance: <message>`` line, else its last line, else the
    exit code or signal."""
    for line in reversed(tail):
        if line.startswith(ERROR_PREFIX):
            return line[len(ERROR_PREFIX):]
    if exit_code is not None and exit_code < 0:
        try:
            name = signal.Signals(-exit_code).name
        except ValueError:
            name = f"signal {-exit_code}"
        ended = f"the benchmark was ended by {name}"
    else:
        ended = f"the benchmark exited with code {exit_code}"
    if tail:
        return f"{ended}: {tail[-1]}"
    return ended


def result_path(folder: Path, now: float) -> Path:
    """A new result file in ``folder``: ``appliance-benchmark-<UTC YYYYmmdd-HHMMSS>.json`` (``-2``, ``-3`` ... when
    that name is taken)."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime(now))
    path = folder / f"{RESULT_PREFIX}{stamp}.json"
    number = 2
    while path.exists():
        path = folder / f"{RESULT_PREFIX}{stamp}-{number}.json"
        number += 1
    return path


def cli_command(config_path: Path, out: Path, quick: bool) -> list[str]:
    """The command line of a run: this Python's ``appliance benchmark`` on the running config's file."""
    command = [sys.executable, "-m", "appliance", "benchmark", "--config", str(config_path), "--progress", "lines",
               "--out", str(out)]
    if quick:
        command.append("--quick")
    return command


CommandLine = Callable[[Path, Path, bool], list[str]]
"""Builds the child's command line from (config file, result file, quick); tests give a stand-in."""


@dataclass(frozen=True)
class JobStatus:
    """A run as the page shows it. ``started_at``/``finished_at`` are wall-clock (epoch) seconds; ``elapsed_s``
    counts to now while running."""

    state: State
    quick: bool = False
    in_place: bool = False
    done: int = 0
    total: int = 0
    label: str = ""
    started_at: float | None = None
    finished_at: float | None = None
    elapsed_s: float = 0.0
    result_file: str | None = None
    exit_code: int | None = None
    error: str | None = None
    tail: tuple[str, ...] = ()

    @property
    def running(self) -> bool:
        return self.state == "running"


class BenchmarkJob:
    """At most one ``appliance benchmark`` child at a time, and what the last one did."""

    def __init__(self, command: CommandLine = cli_command, *, stop_grace_s: float = STOP_GRACE_S) -> None:
        self.command = command
        self.stop_grace_s = stop_grace_s
        self.state: State = "idle"
        self.quick = False
        self.in_place = False
        self.argv: list[str] = []
        self.progress: Step | None = None
        self.started_at: float | None = None
        self.finished_at: float | None = None
        self.result: Path | None = None
        self.exit_code: int | None = None
        self.error: str | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._clock = 0.0
        self._elapsed = 0.0
        self._stopping = False
        self._process: asyncio.subprocess.Process | None = None
        self._watcher: asyncio.Task[None] | None = None

    def status(self) -> JobStatus:
        progress = self.progress or Step(0, 0, "")
        elapsed = time.monotonic() - self._clock if self.state == "running" else self._elapsed
        return JobStatus(self.state, self.quick, self.in_place, progress.done, progress.total, progress.label,
                         self.started_at, self.finished_at, elapsed,
                         self.result.name if self.result is not None else None, self.exit_code, self.error,
                         tuple(self.tail))

    async def start(self, config_path: Path | None, folder: Path, *, quick: bool,
                    socket: Path | None = None, model: str | None = None) -> JobStatus:
        """Start a run on ``config_path`` writing its result into ``folder``; with ``socket``, in place on the
        appliance answering there (``--socket``); with ``model``, on that configured model (``--model``, else the
        config's first). Refused (``BENCHMARK_RUNNING``) while one runs; ``BAD_REQUEST``
        without a config file; ``INTERNAL`` when the child cannot be started."""
        if self.state == "running":
            progress = self.progress or Step(0, 0, "starting")
            raise ApplianceError("BENCHMARK_RUNNING", f"a benchmark is already running ({progress.done} of "
                                 f"{progress.total} steps done): wait for it to finish",
                                 {"started_at": self.started_at, "done": progress.done, "total": progress.total})
        if config_path is None:
            raise ApplianceError("BAD_REQUEST", "this appliance was started without a config file: the benchmark "
                                 "runs on the config file's models", {"config_file": None})
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ApplianceError("INTERNAL", f"cannot create the results folder {folder}: "
                                 f"{exc.strerror or exc}", {"folder": str(folder)}) from None
        out = result_path(folder, time.time())
        self._reset(out, quick)  # from here a second start is refused, even while the child is being spawned
        argv = self.command(config_path, out, quick)
        if socket is not None:
            argv += ["--socket", str(socket)]
        if model is not None:
            argv += ["--model", model]
        self.in_place = socket is not None
        self.argv = argv
        try:
            process = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL,
                stderr=asyncio.subprocess.PIPE, start_new_session=True, limit=MAX_LINE_BYTES)
        except OSError as exc:
            self.error = f"cannot start the benchmark ({argv[0]}): {exc.strerror or exc}"
            self._finish(None, out)
            raise ApplianceError("INTERNAL", self.error, {"command": argv[0]}) from None
        self._process = process
        self._watcher = asyncio.create_task(self._watch(process, out), name="benchmark-job")
        return self.status()

    def _reset(self, out: Path, quick: bool) -> None:
        """A new run, writing ``out``: running, nothing done yet."""
        self.state = "running"
        self.quick = quick
        self.progress = None
        self.started_at = time.time()
        self.finished_at = None
        self.result = out
        self.exit_code = None
        self.error = None
        self._stopping = False
        self.tail.clear()
        self._clock = time.monotonic()

    async def _watch(self, process: asyncio.subprocess.Process, out: Path) -> None:
        assert process.stderr is not None
        try:
            while True:
                try:
                    raw = await process.stderr.readline()
                except ValueError:  # a line over the limit: the stream dropped it
                    self.tail.append(f"(a line over {MAX_LINE_BYTES} bytes was skipped)")
                    continue
                if not raw:
                    break
                self.take_line(raw.decode("utf-8", "replace"))
            code = await process.wait()
        except asyncio.CancelledError:
            self._finish(process.returncode, out)
            raise
        self._finish(code, out)

    def take_line(self, line: str) -> None:
        """One line of the child's stderr: progress, or kept for a failure's explanation."""
        progress = parse_progress(line)
        if progress is not None:
            self.progress = progress
            return
        text = line.strip()
        if text:
            self.tail.append(text[:MAX_TAIL_CHARS])

    def _finish(self, code: int | None, out: Path) -> None:
        self._process = None
        self.exit_code = code
        self.finished_at = time.time()
        self._elapsed = time.monotonic() - self._clock
        if code == 0 and out.is_file():
            self.state = "finished"
            return
        self.state = "failed"
        self.result = None
        if self.error is not None:
            return  # said already (the child could not be started)
        if self._stopping:
            self.error = "stopped: the appliance is shutting down"
        elif code == 0:
            self.error = f"the benchmark exited 0 but wrote no result to {out}"
        else:
            self.error = failure_message(list(self.tail), code)

    async def stop(self) -> None:
        """End a running child (the appliance is stopping): SIGTERM to its process group, SIGKILL after the grace
        period; the run is marked failed. Nothing to do when none runs."""
        process = self._process
        watcher = self._watcher
        if process is None or watcher is None or watcher.done():
            return
        self._stopping = True
        signal_group(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(asyncio.shield(watcher), self.stop_grace_s)
        except TimeoutError:
            signal_group(process.pid, signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(watcher), self.stop_grace_s)
        if not watcher.done():  # its stderr is held open by a process outside its group: stop reading
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher


def signal_group(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to the process group ``pid`` leads (the child and what it started); gone already is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)
