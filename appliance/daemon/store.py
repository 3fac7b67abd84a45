"""The agents' store: every durable agent, its conversation's tokens and its stored responses, in one SQLite file
under the state folder (``<data_dir>/agents.db``), so that a restart, an upgrade, a crash or ``kill -9`` loses no
conversation.

* **What is durable.** Agents that outlive their connection: the line protocol's ``REGISTER``, OpenAI ``user`` agents
  and stored Responses conversations. A MAGN session agent belongs to its connection and dies with it, so it is never
  written.
* **When.** A finished decode is committed before its reply's last line is sent (:meth:`StoreWriter.commit` is
  awaited by the daemon); a cancelled or failed decode rolls its conversation back and commits nothing. Commits are
  batched: the writes that arrive while one transaction runs go together in the next.
* **How durable.** WAL mode with ``synchronous=NORMAL``: a committed transaction is in the WAL file before the
  commit returns, so a crash or ``kill -9`` of the process loses nothing that was committed; a power cut may lose the
  last transactions since the last checkpoint but never corrupts the file (SQLite's own guarantee). ``FULL`` would
  add an ``fsync`` to every decode.
* **Faults.** A write that fails (full disk, read-only folder, I/O error) fails no request: the writes are kept in
  memory (the newest per agent), the problem is reported (health ``degraded``) and the transaction is retried with
  backoff until it goes through; SQLite rolls a failed transaction back, so nothing already stored is touched. A file
  that fails its integrity check at start is moved aside (``agents.db.corrupt-<time>``, ``-2``, ``-3`` … after it
  when that name is taken: an earlier bad store is never overwritten) and a new one begun, with an ERROR log line
  and a health notice.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import logging
import os
import sqlite3
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from appliance.daemon.statefiles import FIRST_RETRY_S, MAX_RETRY_S, retry_delay_s

log = logging.getLogger(__name__)

FILE_NAME = "agents.db"
SCHEMA_VERSION = 1

Kv = Literal["empty", "device", "host", "disk"]
"""Where an agent's KV state was when its record was written (``disk``: in its KV file, :mod:`appliance.daemon.
kvfiles`); after a restart only ``disk`` is worth anything."""

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS agents (
    id TEXT PRIMARY KEY,
    model TEXT NOT NULL,
    model_file TEXT NOT NULL,
    vocabulary TEXT NOT NULL,
    owner TEXT NOT NULL,
    created REAL NOT NULL,
    last_used REAL NOT NULL,
    tokens BLOB NOT NULL,
    kv TEXT NOT NULL,
    kv_file TEXT
);
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    agent TEXT NOT NULL,
    created REAL NOT NULL,
    document TEXT NOT NULL,
    messages TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS responses_by_agent ON responses (agent);
"""


def pack_tokens(tokens: Iterable[int]) -> bytes:
    """Token ids as little-endian int32 bytes."""
    packed = array.array("i", tokens)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_tokens(blob: bytes) -> tuple[int, ...]:
    if len(blob) % 4:
        raise ValueError(f"a token list of {len(blob)} bytes is not whole int32s")
    packed = array.array("i")
    packed.frombytes(blob)
    if sys.byteorder != "little":
        packed.byteswap()
    return tuple(packed)


@dataclass(frozen=True)
class AgentRecord:
    """One durable agent as stored: ``last_used`` and ``created`` are wall-clock times (``agent_idle_ttl_s`` counts
    across a restart from the last use before it); ``model_file`` the identity of the model file its tokens were made
    with, ``vocabulary`` that model's vocabulary digest."""

    id: str
    model: str
    model_file: str
    vocabulary: str
    owner: str
    created: float
    last_used: float
    tokens: tuple[int, ...]
    kv: Kv = "empty"
    kv_file: str | None = None


@dataclass(frozen=True)
class ResponseRecord:
    """One stored Responses response: its document and its conversation's messages through it, as JSON texts."""

    id: str
    agent: str
    created: float
    document: str
    messages: str


@dataclass(frozen=True)
class PutAgent:
    record: AgentRecord

    @property
    def key(self) -> tuple[str, str]:
        return ("agent", self.record.id)


@dataclass(frozen=True)
class DeleteAgent:
    """Forget an agent and every stored response in its conversation."""

    agent: str

    @property
    def key(self) -> tuple[str, str]:
        return ("agent", self.agent)


@dataclass(frozen=True)
class PutResponse:
    record: ResponseRecord

    @property
    def key(self) -> tuple[str, str]:
        return ("response", self.record.id)


@dataclass(frozen=True)
class DeleteResponse:
    response: str

    @property
    def key(self) -> tuple[str, str]:
        return ("response", self.response)


Write = PutAgent | DeleteAgent | PutResponse | DeleteResponse


class StoreCorrupt(Exception):
    """The file is not a readable agents store (integrity check failed, not a database, unknown schema)."""


def file_identity_text(identity: tuple[int, ...]) -> str:
    return ":".join(str(part) for part in identity)


STORE_FILES = ("", "-wal", "-shm")
"""The suffixes of a store's files: the database, its WAL and its shared memory."""
MAX_ASIDE_TRIES = 1000
"""How many names :func:`move_aside` tries for one second before it gives up."""


def corrupt_name(path: Path, now: float, attempt: int = 1) -> Path:
    """``agents.db.corrupt-<UTC time>``, and ``-<attempt>`` after it from the second try on (two failures within
    one second)."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now))
    counter = "" if attempt == 1 else f"-{attempt}"
    return path.with_name(f"{path.name}.corrupt-{stamp}{counter}")


def move_aside(path: Path, now: float) -> Path:
    """Move the store at ``path`` (with its WAL and shared-memory files) to the first :func:`corrupt_name` none of
    whose files exists, never replacing one: each name is claimed with ``O_EXCL`` before its file is renamed onto
    the claim. Returns where the database went; :class:`FileExistsError` when every name is taken."""
    sources = [(suffix, path.with_name(path.name + suffix)) for suffix in STORE_FILES]
    present = [(suffix, source) for suffix, source in sources if source.exists()]
    for attempt in range(1, MAX_ASIDE_TRIES + 1):
        aside = corrupt_name(path, now, attempt)
        claimed = claim_names([aside.with_name(aside.name + suffix) for suffix, _ in present])
        if claimed is None:
            continue
        for (_, source), target in zip(present, claimed, strict=True):
            os.replace(source, target)  # onto our own empty claim: nothing of anyone else's is replaced
        return aside
    raise FileExistsError(f"every name {corrupt_name(path, now)}[-N] up to {MAX_ASIDE_TRIES} is taken")


def claim_names(targets: list[Path]) -> list[Path] | None:
    """Create each of ``targets`` empty with ``O_EXCL``; None (the ones created removed again) when one exists."""
    claimed: list[Path] = []
    for target in targets:
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            for made in claimed:
                with contextlib.suppress(FileNotFoundError):
                    made.unlink()
            return None
        os.close(fd)
        claimed.append(target)
    return claimed


class AgentStore:
    """The SQLite file itself (blocking calls: used at start and by :class:`StoreWriter`'s thread)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        try:
            self._prepare()
        except BaseException:
            self.db.close()
            raise

    def _prepare(self) -> None:
        try:
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")
            checked = self.db.execute("PRAGMA quick_check").fetchall()
            if checked != [("ok",)]:
                raise StoreCorrupt(f"integrity check: {'; '.join(str(row[0]) for row in checked[:3])}")
            self.db.executescript(_SCHEMA)
            row = self.db.execute("SELECT value FROM meta WHERE key = 'schema'").fetchone()
            if row is None:
                self.db.execute("INSERT INTO meta (key, value) VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
            elif row[0] != str(SCHEMA_VERSION):
                raise StoreCorrupt(f"schema version {row[0]!r}, this appliance reads {SCHEMA_VERSION}")
            self.load_agents()  # every row readable
        except sqlite3.DatabaseError as exc:
            if isinstance(exc, sqlite3.OperationalError) and not _corruption(exc):
                raise
            raise StoreCorrupt(str(exc)) from exc

    @classmethod
    def open(cls, path: Path, *, clock: Callable[[], float] = time.time) -> tuple[AgentStore, Path | None]:
        """Open (or begin) the store at ``path``. One that fails its integrity check is moved aside with its WAL
        and shared-memory files (``agents.db.corrupt-<time>``, never over an earlier one: :func:`move_aside`) and a
        new one begun; returns the store and where the bad one went (None when it was good)."""
        try:
            return cls(path), None
        except StoreCorrupt as exc:
            aside = move_aside(path, clock())
            log.error("the agents store %s failed its integrity check (%s): moved aside to %s; a new, empty store "
                      "is begun, and the agents it held are not restored", path, exc, aside)
            return cls(path), aside

    def load_agents(self) -> list[AgentRecord]:
        rows = self.db.execute("SELECT id, model, model_file, vocabulary, owner, created, last_used, tokens, kv, "
                               "kv_file FROM agents ORDER BY last_used").fetchall()
        records = []
        for row in rows:
            try:
                tokens = unpack_tokens(row[7])
            except (TypeError, ValueError) as exc:
                raise StoreCorrupt(f"agent {row[0]!r}: {exc}") from None
            records.append(AgentRecord(row[0], row[1], row[2], row[3], row[4], float(row[5]), float(row[6]),
                                       tokens, row[8], row[9]))
        return records

    def load_responses(self) -> list[ResponseRecord]:
        rows = self.db.execute("SELECT id, agent, created, document, messages FROM responses ORDER BY created")
        return [ResponseRecord(row[0], row[1], float(row[2]), row[3], row[4]) for row in rows.fetchall()]

    def apply(self, writes: Iterable[Write]) -> None:
        """Every write in one transaction: all of them or none."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            for write in writes:
                self._apply(write)
            self.db.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                self.db.execute("ROLLBACK")
            raise

    def _apply(self, write: Write) -> None:
        if isinstance(write, PutAgent):
            r = write.record
            self.db.execute("INSERT OR REPLACE INTO agents (id, model, model_file, vocabulary, owner, created, "
                            "last_used, tokens, kv, kv_file) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                            (r.id, r.model, r.model_file, r.vocabulary, r.owner, r.created, r.last_used,
                             pack_tokens(r.tokens), r.kv, r.kv_file))
        elif isinstance(write, DeleteAgent):
            self.db.execute("DELETE FROM agents WHERE id = ?", (write.agent,))
            self.db.execute("DELETE FROM responses WHERE agent = ?", (write.agent,))
        elif isinstance(write, PutResponse):
            r2 = write.record
            self.db.execute("INSERT OR REPLACE INTO responses (id, agent, created, document, messages) "
                            "VALUES (?, ?, ?, ?, ?)", (r2.id, r2.agent, r2.created, r2.document, r2.messages))
        else:
            self.db.execute("DELETE FROM responses WHERE id = ?", (write.response,))

    def checkpoint(self) -> None:
        """Fold the WAL into the main file (at a graceful stop)."""
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def close(self) -> None:
        self.db.close()


def _corruption(exc: sqlite3.OperationalError) -> bool:
    text = str(exc).lower()
    return "malformed" in text or "not a database" in text or "corrupt" in text


def error_name(exc: BaseException) -> str:
    """The errno name a failed SQLite write stands for (what health shows), from its message."""
    if isinstance(exc, OSError) and exc.errno is not None:
        import errno

        return errno.errorcode.get(exc.errno, str(exc.errno))
    text = str(exc).lower()
    if "full" in text:
        return "ENOSPC"
    if "readonly" in text or "read-only" in text:
        return "EROFS"
    if "i/o" in text:
        return "EIO"
    if "locked" in text or "busy" in text:
        return "EBUSY"
    return type(exc).__name__


@dataclass(frozen=True)
class StoreProblem:
    errno: str
    message: str
    since: float
    failures: int

    @property
    def reason(self) -> str:
        return f"cannot write the agents store: {self.message} ({self.errno}); retrying, agents are kept in memory"

    def to_dict(self) -> dict[str, Any]:
        return {"errno": self.errno, "message": self.message, "since": self.since, "failures": self.failures,
                "reason": self.reason}


class StoreWriter:
    """The store's one writer thread: :meth:`commit` queues writes (the newest per agent and response wins) and
    resolves once a transaction holding them committed (True) or failed (False: they stay queued and are retried
    with backoff; the caller is not held up). :meth:`problem` says why it cannot write now. Given no ``store``
    (it could not be opened at start: a full or read-only state folder), it opens the one at ``path`` before its
    first transaction, retried like any failed write."""

    def __init__(self, store: AgentStore | None, *, path: Path | None = None, first_retry_s: float = FIRST_RETRY_S,
                 max_retry_s: float = MAX_RETRY_S, clock: Callable[[], float] = time.time) -> None:
        if store is None and path is None:
            raise ValueError("a StoreWriter needs a store or the path of one")
        self.store = store
        self.path = store.path if store is not None else path
        self.first_retry_s = first_retry_s
        self.max_retry_s = max_retry_s
        self._clock = clock
        self._pending: dict[tuple[str, str], Write] = {}
        self._waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]]] = []
        self._cond = threading.Condition()
        self._closing = False
        self.problem: StoreProblem | None = None
        self.moved_aside: Path | None = None
        self.transactions = 0
        self.writes = 0
        self.commit_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="agents-store", daemon=True)
        self._thread.start()

    async def commit(self, writes: Iterable[Write]) -> bool:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        with self._cond:
            if self._closing:
                return False
            for write in writes:
                self._pending.pop(write.key, None)  # a newer write goes after the ones queued since
                self._pending[write.key] = write
            self._waiting.append((loop, future))
            self._cond.notify()
        return await asyncio.shield(future)

    def queue(self, writes: Iterable[Write]) -> None:
        """Queue ``writes`` without waiting for their commit (from any thread)."""
        with self._cond:
            for write in writes:
                self._pending.pop(write.key, None)
                self._pending[write.key] = write
            self._cond.notify()

    def report(self) -> dict[str, Any]:
        record: dict[str, Any] = {"status": "ok" if self.problem is None else "degraded",
                                  "path": str(self.path), "transactions": self.transactions,
                                  "writes": self.writes, "pending": len(self._pending)}
        if self.problem is not None:
            record.update(self.problem.to_dict())
        if self.moved_aside is not None:
            record["moved_aside"] = str(self.moved_aside)
        return record

    def _run(self) -> None:
        failures = 0
        while True:
            with self._cond:
                while not self._pending and not self._waiting and not self._closing and self.store is not None:
                    self._cond.wait()
                if self._closing and not self._pending:
                    self._resolve(self._take_waiting(), True)
                    return
                batch = self._pending
                self._pending = {}
                waiting = self._take_waiting()
            started = time.perf_counter()
            try:
                if self.store is None:  # not opened at start: opened (or retried) before anything is written
                    assert self.path is not None
                    self.store = AgentStore(self.path)
                    log.info("the agents store %s is open", self.path)
                if batch:
                    self.store.apply(batch.values())
            except (sqlite3.Error, OSError, StoreCorrupt) as exc:
                failures += 1
                self._failed(exc, failures)
                with self._cond:
                    for key, write in batch.items():  # newer writes queued meanwhile win
                        self._pending.setdefault(key, write)
                    closing = self._closing
                self._resolve(waiting, False)
                if closing:
                    return
                with self._cond:
                    self._cond.wait(retry_delay_s(failures, first_s=self.first_retry_s, max_s=self.max_retry_s))
                continue
            if batch:
                self.transactions += 1
                self.writes += len(batch)
                self.commit_seconds += time.perf_counter() - started
            if self.problem is not None:
                log.info("the agents store is written again, after %d failed transaction(s)", self.problem.failures)
                self.problem = None
            failures = 0
            self._resolve(waiting, True)

    def _take_waiting(self) -> list[tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]]]:
        waiting, self._waiting = self._waiting, []
        return waiting

    def _failed(self, exc: BaseException, failures: int) -> None:
        name = error_name(exc)
        if self.problem is None:
            self.problem = StoreProblem(name, str(exc), self._clock(), failures)
            log.warning("%s", self.problem.reason)
        else:
            self.problem = StoreProblem(name, str(exc), self.problem.since, failures)

    @staticmethod
    def _resolve(waiting: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]]], ok: bool) -> None:
        for loop, future in waiting:
            with contextlib.suppress(RuntimeError):  # its loop closed
                loop.call_soon_threadsafe(_settle, future, ok)

    def close(self, timeout_s: float = 5.0) -> None:
        """Commit what is queued (one try), fold the WAL in and close the file."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout_s)
        if self.store is None:
            return
        with contextlib.suppress(sqlite3.Error):
            self.store.checkpoint()
        with contextlib.suppress(sqlite3.Error):
            self.store.close()


def _settle(future: asyncio.Future[bool], ok: bool) -> None:
    if not future.done():
        future.set_result(ok)


def dumps(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)
