"""The disk tier of parked KV state: ``<data_dir>/kv/``, one :mod:`~appliance.daemon.kvfiles` file per agent,
within ``disk_kv_budget`` (``auto``: a quarter of the free space of the state folder's file system at start, plus
what the folder already holds).

Parked state that no longer fits ``host_kv_budget`` is written here instead of being dropped, and at a graceful stop
every durable agent's live and parked state is written here, so that a restart restores it instead of re-evaluating.
Past the budget the least recently used agents' files are deleted (those agents re-evaluate their tokens, as a host
drop does). A write that fails (full disk, read-only folder) loses only that state, never a request: the agent
re-evaluates its tokens, and the tier reports ``degraded`` until a write (or :meth:`DiskTier.probe`) succeeds again.

Every method but :meth:`report` runs on the engine thread, the one that moves KV state.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.daemon import kvfiles
from appliance.daemon.statefiles import error_name

log = logging.getLogger(__name__)

AUTO_SHARE = 4
"""``auto`` budget: the free space of the state folder's file system divided by this."""
SUFFIX = ".kv"


@dataclass(frozen=True)
class Held:
    key: str
    nbytes: int
    last_used: float


def to_evict(held: Iterable[Held], budget: int, incoming: int, keep: frozenset[str] = frozenset()) -> list[str] | None:
    """The files to delete, least recently used first, so that ``incoming`` more bytes fit in ``budget``; None when
    it cannot fit even with every file but those in ``keep`` deleted (pure)."""
    entries = sorted(held, key=_age)
    total = sum(entry.nbytes for entry in entries)
    evicted: list[str] = []
    for entry in entries:
        if total + incoming <= budget:
            break
        if entry.key in keep:
            continue
        evicted.append(entry.key)
        total -= entry.nbytes
    if total + incoming > budget:
        return None
    return evicted


def _age(entry: Held) -> tuple[float, str]:
    return (entry.last_used, entry.key)


def auto_budget(free_bytes: int, held_bytes: int) -> int:
    return free_bytes // AUTO_SHARE + held_bytes


class DiskTier:
    """The ``kv/`` folder and its index of files (module docstring)."""

    def __init__(self, folder: Path, budget: int | None) -> None:
        self.folder = folder
        self.files: dict[str, Held] = {}
        self.problem: dict[str, Any] | None = None
        try:
            folder.mkdir(exist_ok=True)
            listing = list(folder.iterdir())
        except OSError as exc:  # a full or read-only state folder: degraded until a write or probe succeeds
            listing = []
            self._failed(exc)
        for path in listing:
            if path.name.startswith("."):  # a temporary file of a write that was cut short
                with contextlib.suppress(OSError):
                    path.unlink()
            elif path.suffix == SUFFIX:
                with contextlib.suppress(OSError):
                    self.files[path.stem] = Held(path.stem, path.stat().st_size, path.stat().st_mtime)
        held = sum(entry.nbytes for entry in self.files.values())
        if budget is None:
            stat = os.statvfs(folder.parent)
            budget = auto_budget(stat.f_bavail * stat.f_frsize, held)
        self.budget = budget
        self.counters = {"writes": 0, "write_bytes": 0, "reads": 0, "read_bytes": 0, "evictions": 0,
                         "discarded": 0, "failures": 0}
        self.write_seconds = 0.0
        self.read_seconds = 0.0

    def path(self, key: str) -> Path:
        return self.folder / f"{key}{SUFFIX}"

    def holds(self, key: str) -> bool:
        return key in self.files

    @property
    def held_bytes(self) -> int:
        return sum(entry.nbytes for entry in self.files.copy().values())  # dict.copy: whole under the GIL

    def adopt(self, keys: Iterable[str], last_used: dict[str, float]) -> list[str]:
        """Keep the files of ``keys`` (the agents restored at start, with their last use) and delete the others;
        returns the keys deleted."""
        wanted = set(keys)
        orphans = [key for key in self.files if key not in wanted]
        for key in orphans:
            self.discard(key, None)
        for key, entry in list(self.files.items()):
            self.files[key] = Held(key, entry.nbytes, last_used.get(key, entry.last_used))
        return orphans

    def write(self, key: str, validity: kvfiles.Validity, tokens: Sequence[int], state: memoryview | bytes,
              last_used: float, keep: frozenset[str] = frozenset()) -> tuple[bool, list[str]]:
        """Write ``key``'s state, deleting the least recently used files first if the budget needs it; returns
        whether it was written and the keys whose files went. Never raises :class:`OSError`."""
        incoming = len(state) + 4096
        others = [entry for entry in self.files.values() if entry.key != key]
        evicted = to_evict(others, self.budget, incoming, keep)
        if evicted is None:
            log.info("disk KV: agent %s's state (%d bytes) does not fit disk_kv_budget (%d bytes): its next decode "
                     "re-evaluates its tokens", key, len(state), self.budget)
            self.discard(key, None)
            return False, []
        for victim in evicted:
            self.discard(victim, "disk_kv_budget")
            self.counters["evictions"] += 1
        started = time.perf_counter()
        try:
            self.folder.mkdir(exist_ok=True)
            size = kvfiles.write(self.path(key), validity, tokens, state)
        except OSError as exc:
            self.counters["failures"] += 1
            self.discard(key, None)
            self._failed(exc)
            return False, evicted
        self.write_seconds += time.perf_counter() - started
        self.counters["writes"] += 1
        self.counters["write_bytes"] += size
        self.files[key] = Held(key, size, last_used)
        self._recovered()
        return True, evicted

    def read(self, key: str, validity: kvfiles.Validity, tokens: Sequence[int]) -> tuple[bytearray, int] | None:
        """``key``'s state and its token count, or None (with a log line, the file deleted) when it is missing or
        fails its checks: the caller re-evaluates the tokens."""
        started = time.perf_counter()
        try:
            state, n_tokens = kvfiles.read(self.path(key), validity, tokens)
        except (kvfiles.KvFileError, OSError) as exc:
            log.warning("disk KV: agent %s's file %s is discarded (%s): its tokens are re-evaluated", key,
                        self.path(key), exc)
            self.counters["discarded"] += 1
            self.discard(key, None)
            return None
        self.read_seconds += time.perf_counter() - started
        self.counters["reads"] += 1
        self.counters["read_bytes"] += len(state)
        return state, n_tokens

    def discard(self, key: str, reason: str | None) -> None:
        """Delete ``key``'s file (none there: nothing to say); ``reason`` is logged when it is not None."""
        self.files.pop(key, None)
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("disk KV: cannot delete %s: %s", self.path(key), exc)
            return
        if reason is not None:
            log.info("disk KV: agent %s's state deleted (%s)", key, reason)

    def probe(self) -> None:
        """While degraded, try a small write: a folder that has room again clears the problem."""
        if self.problem is None:
            return
        probe = self.folder / ".probe"
        try:
            self.folder.mkdir(exist_ok=True)
            with open(probe, "wb") as fh:
                fh.write(b"\0" * 4096)
                fh.flush()
                os.fsync(fh.fileno())
        except OSError:
            return
        finally:
            with contextlib.suppress(OSError):
                probe.unlink()
        self._recovered()

    def _failed(self, exc: OSError) -> None:
        name = error_name(exc)
        message = exc.strerror or str(exc)
        if self.problem is None:
            log.warning("disk KV: cannot write to %s: %s (%s); parked state that does not fit host RAM is dropped "
                        "(re-evaluated from tokens) meanwhile", self.folder, message, name)
            self.problem = {"errno": name, "message": message, "since": time.time(),
                            "reason": f"cannot write KV files in {self.folder}: {message} ({name})"}
        else:
            self.problem = {**self.problem, "errno": name, "message": message}

    def _recovered(self) -> None:
        if self.problem is not None:
            log.info("disk KV: %s is writable again", self.folder)
            self.problem = None

    def report(self) -> dict[str, Any]:
        record: dict[str, Any] = {"status": "ok" if self.problem is None else "degraded",
                                  "budget_bytes": self.budget, "held_bytes": self.held_bytes,
                                  "files": len(self.files), **self.counters.copy()}
        if self.problem is not None:
            record.update(self.problem)
        return record
