"""The agents' store (SQLite): records round-trip, batched commits, failures kept and retried, a corrupt file moved
aside, a transaction all or nothing."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import pytest

from appliance.daemon import store
from appliance.daemon.store import (
    AgentRecord,
    AgentStore,
    DeleteAgent,
    DeleteResponse,
    PutAgent,
    PutResponse,
    ResponseRecord,
    StoreWriter,
    move_aside,
)


def record(agent: str, tokens: tuple[int, ...] = (1, 2, 3), last_used: float = 100.0) -> AgentRecord:
    return AgentRecord(agent, "demo", "1:2:3:4", "vocab", "client", 50.0, last_used, tokens, "disk",
                       f"kv/{agent}.kv")


def test_tokens_pack_as_int32_and_back() -> None:
    tokens = (0, 1, 151643, 2**31 - 1, -1)
    assert store.unpack_tokens(store.pack_tokens(tokens)) == tokens
    assert len(store.pack_tokens(tokens)) == 20
    with pytest.raises(ValueError):
        store.unpack_tokens(b"abc")


def test_records_round_trip_and_deleting_an_agent_deletes_its_responses(tmp_path: Path) -> None:
    db = AgentStore(tmp_path / "agents.db")
    db.apply([PutAgent(record("a", tuple(range(2000)))), PutAgent(record("b", last_used=50.0)),
              PutResponse(ResponseRecord("resp_1", "a", 1.0, '{"id":"resp_1"}', "[]")),
              PutResponse(ResponseRecord("resp_2", "b", 2.0, '{"id":"resp_2"}', "[]"))])
    db.close()
    again = AgentStore(tmp_path / "agents.db")
    assert [r.id for r in again.load_agents()] == ["b", "a"]  # by last use
    assert again.load_agents()[1] == record("a", tuple(range(2000)))
    again.apply([DeleteAgent("a"), DeleteResponse("nothing")])
    assert [r.id for r in again.load_agents()] == ["b"]
    assert [r.id for r in again.load_responses()] == ["resp_2"]


def test_a_transaction_is_all_or_nothing(tmp_path: Path) -> None:
    db = AgentStore(tmp_path / "agents.db")
    db.apply([PutAgent(record("a"))])
    bad = PutAgent(AgentRecord("b", "demo", "", "", "client", 0.0, 0.0, (1,), "empty", None))
    broken = PutResponse(ResponseRecord("r", "b", 0.0, None, "[]"))  # type: ignore[arg-type]  # NOT NULL fails
    with pytest.raises(sqlite3.IntegrityError):
        db.apply([bad, broken])
    assert [r.id for r in db.load_agents()] == ["a"]


def test_the_store_is_in_wal_mode_with_synchronous_normal(tmp_path: Path) -> None:
    db = AgentStore(tmp_path / "agents.db")
    assert db.db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert db.db.execute("PRAGMA synchronous").fetchone() == (1,)  # NORMAL


@pytest.mark.parametrize("garbage", [b"this is not a database at all" * 100, b"SQLite format 3\0" + b"\xff" * 8000])
def test_a_corrupt_store_is_moved_aside_and_a_new_one_begun(tmp_path: Path, garbage: bytes,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "agents.db"
    path.write_bytes(garbage)
    db, aside = AgentStore.open(path, clock=lambda: 0.0)
    assert aside == tmp_path / "agents.db.corrupt-19700101T000000"
    assert aside.read_bytes() == garbage  # kept as it was, for whoever wants to look
    assert db.load_agents() == []
    assert any(r.levelname == "ERROR" and "moved aside" in r.getMessage() for r in caplog.records)


def test_two_corrupt_stores_within_one_second_are_both_kept(tmp_path: Path) -> None:
    """A second bad store moved aside within the same second (a crash loop) goes to a new name: the first one is
    never overwritten."""
    path = tmp_path / "agents.db"
    kept: dict[Path, bytes] = {}
    for attempt in range(3):
        garbage = f"not a database, try {attempt}".encode() * 100
        path.write_bytes(garbage)
        db, aside = AgentStore.open(path, clock=lambda: 0.0)
        db.close()
        assert aside is not None and aside not in kept
        kept[aside] = garbage
    assert sorted(p.name for p in kept) == ["agents.db.corrupt-19700101T000000",
                                            "agents.db.corrupt-19700101T000000-2",
                                            "agents.db.corrupt-19700101T000000-3"]
    for aside, garbage in kept.items():
        assert aside.read_bytes() == garbage


def test_a_store_is_moved_aside_with_its_wal_never_over_another(tmp_path: Path) -> None:
    path = tmp_path / "agents.db"
    for attempt in range(2):
        path.write_bytes(b"db %d" % attempt)
        (tmp_path / "agents.db-wal").write_bytes(b"wal %d" % attempt)
        aside = move_aside(path, 0.0)
        assert aside.read_bytes() == b"db %d" % attempt
        assert not path.exists() and not (tmp_path / "agents.db-wal").exists()
    first = tmp_path / "agents.db.corrupt-19700101T000000"
    assert (first.read_bytes(), first.with_name(first.name + "-wal").read_bytes()) == (b"db 0", b"wal 0")
    second = tmp_path / "agents.db.corrupt-19700101T000000-2"
    assert (second.read_bytes(), second.with_name(second.name + "-wal").read_bytes()) == (b"db 1", b"wal 1")


def test_a_name_taken_by_any_of_the_store_files_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "agents.db"
    path.write_bytes(b"x" * 100)
    (tmp_path / "agents.db-wal").write_bytes(b"new wal")
    stray = tmp_path / "agents.db.corrupt-19700101T000000-wal"  # an earlier WAL whose database was deleted
    stray.write_bytes(b"old wal")
    aside = move_aside(path, 0.0)
    assert aside.name == "agents.db.corrupt-19700101T000000-2"
    assert stray.read_bytes() == b"old wal"
    assert not (tmp_path / "agents.db.corrupt-19700101T000000").exists()  # its claim was given back
    assert aside.read_bytes() == b"x" * 100 and not path.exists()


def test_a_store_whose_page_was_damaged_fails_its_check(tmp_path: Path) -> None:
    path = tmp_path / "agents.db"
    db = AgentStore(path)
    db.apply([PutAgent(record(f"agent{i}", tuple(range(500)))) for i in range(40)])
    db.checkpoint()
    db.close()
    data = bytearray(path.read_bytes())
    assert len(data) > 3 * 4096
    data[4096: 4096 + 200] = b"\x07" * 200  # page 2's b-tree header and cell pointers
    path.write_bytes(bytes(data))
    db, aside = AgentStore.open(path)
    assert aside is not None
    assert db.load_agents() == []


def test_commits_are_batched_and_the_newest_write_of_an_agent_wins(tmp_path: Path) -> None:
    db = AgentStore(tmp_path / "agents.db")
    writer = StoreWriter(db)

    async def main() -> list[bool]:
        writes = [writer.commit([PutAgent(record("a", (i,)))]) for i in range(50)]
        return list(await asyncio.gather(*writes))

    try:
        assert asyncio.run(main()) == [True] * 50
        assert writer.transactions < 50  # those that arrived while one ran went in the next
        assert AgentStore(tmp_path / "agents.db").load_agents()[0].tokens == (49,)
    finally:
        writer.close()


class FailingStore:
    """An AgentStore whose transactions fail like a full disk until ``room`` is set."""

    def __init__(self, real: AgentStore) -> None:
        self.real = real
        self.path = real.path
        self.room = False
        self.tries = 0

    def apply(self, writes: object) -> None:
        self.tries += 1
        if not self.room:
            raise sqlite3.OperationalError("database or disk is full")
        self.real.apply(writes)  # type: ignore[arg-type]

    def checkpoint(self) -> None:
        self.real.checkpoint()

    def close(self) -> None:
        self.real.close()


def test_a_failed_commit_is_kept_retried_and_reported_until_it_goes_through(tmp_path: Path) -> None:
    failing = FailingStore(AgentStore(tmp_path / "agents.db"))
    writer = StoreWriter(failing, first_retry_s=0.01, max_retry_s=0.05)  # type: ignore[arg-type]

    async def main() -> None:
        assert await writer.commit([PutAgent(record("a", (1,)))]) is False  # the caller is not held up
        report = writer.report()
        assert report["status"] == "degraded"
        assert report["errno"] == "ENOSPC"
        assert "agents store" in report["reason"]
        assert await writer.commit([PutAgent(record("a", (1, 2)))]) is False
        while failing.tries < 4:  # retried on its own, with backoff
            await asyncio.sleep(0.01)
        failing.room = True
        for _ in range(200):
            if writer.report()["status"] == "ok" and writer.report()["pending"] == 0:
                break
            await asyncio.sleep(0.01)

    try:
        asyncio.run(main())
        assert writer.report()["status"] == "ok"
        assert [r.tokens for r in AgentStore(tmp_path / "agents.db").load_agents()] == [(1, 2)]
    finally:
        writer.close()


def test_sqlite_messages_name_their_errno() -> None:
    assert store.error_name(sqlite3.OperationalError("database or disk is full")) == "ENOSPC"
    assert store.error_name(sqlite3.OperationalError("attempt to write a readonly database")) == "EROFS"
    assert store.error_name(sqlite3.OperationalError("disk I/O error")) == "EIO"
