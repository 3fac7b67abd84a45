"""Hot reload (SPEC C3): notice a change, validate, diff, plan, apply, record, one at a time.

:class:`Reloader` is the loop. Triggers (a watcher seeing the file change, SIGHUP, an API call) only *request* a
reload; requests that arrive while one is being applied are coalesced into the next one, so reloads never overlap
and a burst of triggers is one reload. Each reload:

1. reads and fully validates the file (off the event loop), reading it again right after, until
   :func:`~appliance.supervisor.settle.decide` says it may go on: a file caught half-written (it changed between
   the reads), or one that would retire a model or move a listener, or is invalid or does not end with a
   newline, is decided only once it has been stable for ``settle_s``; a file with no settings (empty, only
   comments) is refused, never applied. A file that keeps changing for ``settle_deadline_s`` is refused too (it is
   read again at its next change). An invalid or refused file changes nothing: the problems become the current
   :attr:`Reloader.problems` (``degraded`` in health and STATUS) until a valid file replaces them;
2. diffs it against the running config and turns the diff into a :class:`~appliance.supervisor.plan.ReloadPlan`;
3. hands the plan to the :class:`Applier` (the application object), which carries it out;
4. records the outcome (:class:`~appliance.supervisor.record.Reload`), logs one line, and tells systemd
   (RELOADING=1 before, READY=1 after).

The reloader knows the application only through :class:`Applier`, so tests drive it with a fake one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from appliance.config.diff import ConfigDiff, diff
from appliance.config.types import Config
from appliance.config.validate import ConfigInvalid, Problem, load_config
from appliance.supervisor.notify import Notifier
from appliance.supervisor.plan import ReloadPlan, plan
from appliance.supervisor.record import Reload, ReloadHistory, Trigger
from appliance.supervisor.settle import SETTLE_S, Decision, Effect, Read, decide
from appliance.supervisor.watch import FileWatcher, Fingerprint, PollingWatcher, WatchfilesWatcher, fingerprint, read

log = logging.getLogger(__name__)

POLL_INTERVAL_S = 2.0
"""The polling watcher's period: the longest an edit inotify cannot see waits (two looks must agree)."""
SETTLE_DEADLINE_S = 10.0
"""The longest one reload waits for the file to settle; a file still changing then is refused (``invalid``)."""


class ApplyFailed(Exception):
    """An applier carried out part of a plan and failed at the rest: ``applied`` is what it did (one line),
    ``error`` what it could not do and why."""

    def __init__(self, error: str, applied: str) -> None:
        super().__init__(error)
        self.error = error
        self.applied = applied


class Stopping(Exception):
    """The appliance began to stop while a reload waited for the file to settle: nothing was applied."""


@dataclass(frozen=True)
class Reading:
    """A settled read of the file: the read, what it loaded (a config, or why it is invalid), the diff of a valid
    one against the running config, and :func:`~appliance.supervisor.settle.decide`'s decision."""

    read: Read
    loaded: Config | ConfigInvalid
    decision: Decision
    changes: ConfigDiff | None = None


class Applier(Protocol):
    """What the reloader needs from the application."""

    @property
    def config(self) -> Config:
        """The config running now."""
        ...

    async def apply(self, new: Config, plan: ReloadPlan) -> str:
        """Carry out ``plan`` towards ``new``; return what was applied (one line). Raises :class:`ApplyFailed`
        when it did part of it, anything else when it did nothing."""
        ...

    def ready_status(self) -> str:
        """One line for systemd's STATUS= (models loaded, agents, ...)."""
        ...

    def replaced_files(self) -> tuple[str, ...]:
        """The loaded models whose file on disk was replaced since they were loaded."""
        ...


def load(path: Path) -> Config:
    return load_config(path)


class Reloader:
    """Reloads ``path`` into ``applier`` on request; owns the reload history, the current problems, and the
    watchers of the file (started by :meth:`run`)."""

    def __init__(self, path: Path, applier: Applier, notifier: Notifier | None = None, *,
                 poll_interval_s: float = POLL_INTERVAL_S, loader: Callable[[Path], Config] = load,
                 settle_s: float = SETTLE_S, settle_deadline_s: float = SETTLE_DEADLINE_S) -> None:
        self.path = path
        self.applier = applier
        self.notifier = notifier or Notifier(None)
        self.poll_interval_s = poll_interval_s
        self.settle_s = settle_s
        self.settle_deadline_s = max(settle_deadline_s, 2 * settle_s)  # a settled file is always decided in time
        self.loader = loader
        self.history = ReloadHistory()
        self.results: collections.Counter[str] = collections.Counter()  # every reload's result, counted (metrics)
        self.problems: tuple[Problem, ...] = ()  # of the file on disk, when it is invalid
        self.seen: Fingerprint = fingerprint(path)  # the file as the last reload (or the start) read it
        self._requested: Trigger | None = None
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._lock = asyncio.Lock()
        self.stop = asyncio.Event()

    @property
    def degraded(self) -> bool:
        return bool(self.problems)

    def request(self, trigger: Trigger) -> None:
        """Ask for a reload (from the loop thread); several requests before it runs are one reload."""
        if self._requested is None:
            self._requested = trigger
        self._idle.clear()
        self._wake.set()

    async def settled(self) -> None:
        """Wait until every requested reload has run (tests, and the API's synchronous reload)."""
        await self._idle.wait()

    def watchers(self) -> list[FileWatcher]:
        def changed() -> None:
            self.request("file")

        return [WatchfilesWatcher(self.path, changed, self.stop),
                PollingWatcher(self.path, changed, self.stop, interval_s=self.poll_interval_s)]

    async def run(self) -> None:
        """Watch the file and run requested reloads until :attr:`stop` is set."""
        tasks = [asyncio.create_task(watcher.run(), name=f"watch-{type(watcher).__name__}")
                 for watcher in self.watchers()]
        if fingerprint(self.path) != self.seen:  # saved before the watchers took their first look
            self.request("file")
        try:
            while not self.stop.is_set():
                stopping = asyncio.ensure_future(self.stop.wait())
                waking = asyncio.ensure_future(self._wake.wait())
                await asyncio.wait({stopping, waking}, return_when=asyncio.FIRST_COMPLETED)
                stopping.cancel()
                waking.cancel()
                if self.stop.is_set():
                    break
                self._wake.clear()
                trigger = self._requested or "file"
                self._requested = None
                if trigger != "file" or fingerprint(self.path) != self.seen:
                    await self.reload(trigger)  # a watcher that noticed what another already reported: no reload
                if self._requested is None:
                    self._idle.set()
        finally:
            self.stop.set()
            for task in tasks:
                task.cancel()
            for task in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            self._idle.set()

    async def reload(self, trigger: Trigger) -> Reload:
        """One reload, now (serialized with any other)."""
        async with self._lock:
            started = time.time()
            clock = time.perf_counter()
            self.notifier.reloading()
            try:
                record = await self._reload(trigger, started, clock)
            finally:
                self.notifier.ready(self.applier.ready_status())
        self.history.add(record)
        self.results[record.result] += 1
        if record.result in ("invalid", "failed"):
            log.warning("%s", record.line())
        else:
            log.info("%s", record.line())
        return record

    async def _reload(self, trigger: Trigger, started: float, clock: float) -> Reload:
        def elapsed_ms() -> float:
            return (time.perf_counter() - clock) * 1000

        try:
            reading = await self._settled_reading(trigger)
        except Stopping:
            return Reload(started, trigger, "failed", "", "", (), elapsed_ms(),
                          error="not applied: the appliance is stopping")
        self.seen = reading.read.fingerprint
        decision = reading.decision
        if decision.action == "refuse":
            self.problems = (Problem("", None, f"refused: {decision.reason}; the running config is kept",
                                     str(self.path)),)
            return Reload(started, trigger, "invalid", "", "", (), elapsed_ms(),
                          problems=tuple(str(problem) for problem in self.problems))
        if isinstance(reading.loaded, ConfigInvalid):
            self.problems = reading.loaded.problems
            return Reload(started, trigger, "invalid", "", "", (), elapsed_ms(),
                          problems=tuple(str(problem) for problem in self.problems))
        self.problems = ()
        new = reading.loaded
        changes = reading.changes
        assert changes is not None  # a valid read carries its diff
        steps = plan(changes, self.applier.replaced_files())
        if steps.empty:
            return Reload(started, trigger, "unchanged", changes.summary(), "no changes", (), elapsed_ms())
        if decision.reason:
            log.warning("reload (%s) applies %s, stable for %g s, although %s", trigger, self.path, self.settle_s,
                        decision.reason)
        try:
            applied = await self.applier.apply(new, steps)
        except ApplyFailed as exc:
            return Reload(started, trigger, "failed", changes.summary(), exc.applied, steps.restart_needed,
                          elapsed_ms(), error=exc.error)
        except Exception as exc:
            log.exception("reload failed while applying: %s", steps.summary())
            return Reload(started, trigger, "failed", changes.summary(), "", steps.restart_needed, elapsed_ms(),
                          error=f"{type(exc).__name__}: {exc}")
        return Reload(started, trigger, "applied", changes.summary(), applied, steps.restart_needed, elapsed_ms())

    async def _settled_reading(self, trigger: Trigger) -> Reading:
        """Read, load and read the file again until :func:`~appliance.supervisor.settle.decide` no longer says
        wait, or :attr:`settle_deadline_s` has passed (then the decision is a refusal); raises :class:`Stopping`
        when :attr:`stop` is set meanwhile."""
        deadline = time.monotonic() + self.settle_deadline_s
        poll_s = max(0.02, self.settle_s / 4)
        since: Read | None = None  # the first read since which the file has not changed
        waited = False
        while True:
            before = await asyncio.to_thread(read, self.path)
            try:
                loaded: Config | ConfigInvalid = await asyncio.to_thread(self.loader, self.path)
            except ConfigInvalid as exc:
                loaded = exc
            after = await asyncio.to_thread(read, self.path)
            if since is None or since.fingerprint != before.fingerprint:
                since = before
            changes = None if isinstance(loaded, ConfigInvalid) else diff(self.applier.config, loaded)
            decision = decide(since, after, self._effect(loaded, changes), self.settle_s)
            if decision.action != "wait":
                return Reading(after, loaded, decision, changes)
            if time.monotonic() >= deadline:
                reason = f"{self.path} was still not settled after {self.settle_deadline_s:g} s ({decision.reason})"
                return Reading(after, loaded, Decision("refuse", reason), changes)
            if not waited:
                log.info("reload (%s) waits for %s to settle: %s", trigger, self.path, decision.reason)
                waited = True
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), poll_s)
            if self.stop.is_set():
                raise Stopping

    def _effect(self, loaded: Config | ConfigInvalid, changes: ConfigDiff | None) -> Effect:
        """What ``loaded`` would do to the running config (the models it retires, the listeners it moves)."""
        if isinstance(loaded, ConfigInvalid) or changes is None:
            return Effect(valid=False)
        steps = plan(changes)
        moved = (("the socket",) if steps.rebind_socket else ()) + (("HTTP",) if steps.rebind_http else ())
        every_model = bool(self.applier.config.models) and not loaded.models
        return Effect(valid=True, retired=steps.retire_models, every_model=every_model, moved=moved)
