"""Watching ``appliance.yaml`` for changes (SPEC C3): a small base loop and two ways to notice a change.

:class:`FileWatcher` is the base: it runs until its ``stop`` event is set and calls ``on_change()`` whenever the
file's :func:`fingerprint` (inode, size, mtime and a hash of the bytes) differs from the last one it saw, so an
event that did not change the content does nothing. Subclasses only say *when to look*:

* :class:`WatchfilesWatcher` looks when inotify (through ``watchfiles``) reports anything in the file's folder: the
  folder, not the file, so that atomic-rename saves (vim, ``sed -i``, config management) are seen; a burst of
  writes is one look after watchfiles' debounce;
* :class:`PollingWatcher` looks every ``interval_s``: the fallback for what inotify cannot see (bind mounts, a
  symlink whose target is replaced elsewhere).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from appliance.supervisor.settle import Read

log = logging.getLogger(__name__)
logging.getLogger("watchfiles").setLevel(logging.WARNING)
"""watchfiles logs every change it sees in the config's folder at INFO: a log file kept in that folder would
then log a line per line it logged, forever."""

MAX_HASHED_BYTES = 4 * 1024 * 1024  # a config is at most 1 MiB: anything beyond this is hashed by its stat only

Fingerprint = tuple[int, int, int, str] | None
"""(inode, size, mtime_ns, sha256 of the content), or None when the file cannot be read."""


def fingerprint(path: Path) -> Fingerprint:
    """What identifies the file's current content; follows symlinks (the target is what is read)."""
    return read(path).fingerprint


def read(path: Path, clock: Callable[[], float] = time.monotonic) -> Read:
    """One look at the file: its fingerprint and bytes (at most :data:`MAX_HASHED_BYTES`), and ``clock()`` once
    they were read (:func:`appliance.supervisor.settle.decide` compares two such reads)."""
    try:
        stat = path.stat()
        with open(path, "rb") as fh:
            data = fh.read(MAX_HASHED_BYTES)
    except OSError:
        return Read(None, None, clock())
    return Read((stat.st_ino, stat.st_size, stat.st_mtime_ns, hashlib.sha256(data).hexdigest()), data, clock())


class FileWatcher:
    """Calls ``on_change()`` (on the loop) each time the file's content may have changed, until ``stop`` is set."""

    def __init__(self, path: Path, on_change: Callable[[], None], stop: asyncio.Event) -> None:
        self.path = path
        self.on_change = on_change
        self.stop = stop
        self.last: Fingerprint = fingerprint(path)

    def look(self) -> bool:
        """Compare the file with the last look; True (and ``on_change()``) when it differs."""
        now = fingerprint(self.path)
        if now == self.last:
            return False
        self.last = now
        self.on_change()
        return True

    async def run(self) -> None:
        raise NotImplementedError


class PollingWatcher(FileWatcher):
    """Looks every ``interval_s``; a change counts once two looks in a row agree on it (a save in progress, or a
    burst of writes, is not reported half-way)."""

    def __init__(self, path: Path, on_change: Callable[[], None], stop: asyncio.Event,
                 interval_s: float = 2.0) -> None:
        super().__init__(path, on_change, stop)
        self.interval_s = interval_s
        self.pending: Fingerprint = self.last

    def look(self) -> bool:
        now = fingerprint(self.path)
        settled = now == self.pending
        self.pending = now
        if not settled or now == self.last:
            return False
        self.last = now
        self.on_change()
        return True

    async def run(self) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stop.wait(), self.interval_s)
            if not self.stop.is_set():
                self.look()


class WatchfilesWatcher(FileWatcher):
    """Looks when watchfiles reports a change in the file's folder (or in its symlink target's folder)."""

    def __init__(self, path: Path, on_change: Callable[[], None], stop: asyncio.Event,
                 debounce_ms: int = 200) -> None:
        super().__init__(path, on_change, stop)
        self.debounce_ms = debounce_ms

    def folders(self) -> list[Path]:
        folders = [self.path.parent]
        target = Path(os.path.realpath(self.path)).parent
        if target != self.path.parent:
            folders.append(target)
        return [folder for folder in folders if folder.is_dir()]

    async def run(self) -> None:
        import watchfiles

        folders = self.folders()
        if not folders:
            log.warning("cannot watch %s: its folder does not exist", self.path)
            return
        async for _changes in watchfiles.awatch(*folders, stop_event=self.stop, debounce=self.debounce_ms,
                                                recursive=False):
            self.look()
