"""KV files and the disk tier: a file round-trips, every kind of damage or mismatch is refused with its reason, the
budget evicts the least recently used, a failed write loses only that state."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from appliance.daemon import diskkv, kvfiles
from appliance.daemon.diskkv import DiskTier, Held, to_evict
from appliance.daemon.kvfiles import KvFileError, Validity

VALID = Validity("1:2:3:4", 512, "f16", True)
TOKENS = list(range(100, 164))
STATE = bytes(range(256)) * 40


def test_a_file_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "a.kv"
    size = kvfiles.write(path, VALID, TOKENS, STATE)
    assert size == path.stat().st_size
    state, n_tokens = kvfiles.read(path, VALID, TOKENS + [7, 8])  # the conversation went on since: a prefix
    assert bytes(state) == STATE
    assert n_tokens == len(TOKENS)
    assert [p.name for p in tmp_path.iterdir()] == ["a.kv"]  # no temporary file left


@pytest.mark.parametrize(("changed", "reason"), [
    (Validity("9:2:3:4", 512, "f16", True), "model_file"),
    (Validity("1:2:3:4", 1024, "f16", True), "n_ctx"),
    (Validity("1:2:3:4", 512, "q8_0", True), "cache_type"),
    (Validity("1:2:3:4", 512, "f16", False), "flash_attention"),
])
def test_a_file_made_for_something_else_is_refused(tmp_path: Path, changed: Validity, reason: str) -> None:
    path = tmp_path / "a.kv"
    kvfiles.write(path, VALID, TOKENS, STATE)
    with pytest.raises(KvFileError, match=reason):
        kvfiles.read(path, changed, TOKENS)


def test_other_tokens_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.kv"
    kvfiles.write(path, VALID, TOKENS, STATE)
    with pytest.raises(KvFileError, match="not the conversation's"):
        kvfiles.read(path, VALID, [1] + TOKENS[1:])
    with pytest.raises(KvFileError, match="holds 64 tokens"):
        kvfiles.read(path, VALID, TOKENS[:10])


def damaged(data: bytes, where: str) -> bytes:
    head = len(kvfiles.encode_header(kvfiles.Header(1, "", 0, "", False, 0, "", 0, 0)))
    if where == "payload":
        flipped = bytearray(data)
        flipped[-100] ^= 0x01
        return bytes(flipped)
    if where == "truncated":
        return data[:-1]
    if where == "longer":
        return data + b"\0"
    if where == "magic":
        return b"X" + data[1:]
    if where == "header":
        return data[:len(kvfiles.MAGIC) + 6] + b"\xff" + data[len(kvfiles.MAGIC) + 7:]
    if where == "empty":
        return b""
    assert where == "short-header"
    return data[:head // 2]


@pytest.mark.parametrize("where", ["payload", "truncated", "longer", "magic", "header", "empty", "short-header"])
def test_damage_is_refused(tmp_path: Path, where: str) -> None:
    path = tmp_path / "a.kv"
    kvfiles.write(path, VALID, TOKENS, STATE)
    path.write_bytes(damaged(path.read_bytes(), where))
    with pytest.raises(KvFileError):
        kvfiles.read(path, VALID, TOKENS)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=600))
def test_any_bytes_are_a_kv_file_error_or_a_valid_state(tmp_path_factory: pytest.TempPathFactory,
                                                        data: bytes) -> None:
    path = tmp_path_factory.mktemp("fuzz") / "a.kv"
    path.write_bytes(data)
    with pytest.raises(KvFileError):
        kvfiles.read(path, VALID, TOKENS)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "a.kv"
    kvfiles.write(path, VALID, TOKENS, STATE)
    before = path.read_bytes()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        kvfiles.write(path, VALID, TOKENS, b"other" * 100)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["a.kv"]


def test_eviction_takes_the_least_recently_used_first() -> None:
    held = [Held("old", 100, 1.0), Held("mid", 100, 2.0), Held("new", 100, 3.0)]
    assert to_evict(held, 400, 100) == []
    assert to_evict(held, 400, 150) == ["old"]
    assert to_evict(held, 400, 350) == ["old", "mid", "new"]
    assert to_evict(held, 400, 350, keep=frozenset({"old"})) is None
    assert to_evict(held, 400, 250, keep=frozenset({"old"})) == ["mid", "new"]
    assert to_evict([], 100, 101) is None


def test_the_tier_writes_within_its_budget_and_evicts(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path / "kv", budget=3 * (len(STATE) + 4500))
    for i, key in enumerate(["a", "b", "c"]):
        written, evicted = tier.write(key, VALID, TOKENS, STATE, last_used=float(i))
        assert written and evicted == []
    written, evicted = tier.write("d", VALID, TOKENS, STATE, last_used=10.0)
    assert written
    assert evicted == ["a"]
    assert not tier.path("a").exists()
    assert tier.read("a", VALID, TOKENS) is None
    got = tier.read("b", VALID, TOKENS)
    assert got is not None and bytes(got[0]) == STATE
    assert tier.held_bytes <= tier.budget


def test_a_bad_file_is_discarded_with_a_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = DiskTier(tmp_path / "kv", budget=10**8)
    tier.write("a", VALID, TOKENS, STATE, last_used=0.0)
    tier.path("a").write_bytes(damaged(tier.path("a").read_bytes(), "payload"))
    assert tier.read("a", VALID, TOKENS) is None
    assert not tier.path("a").exists()
    assert not tier.holds("a")
    assert "checksum mismatch" in caplog.text


def test_discarding_an_agent_without_a_file_says_nothing_and_a_failed_delete_warns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    tier = DiskTier(tmp_path / "kv", budget=10**8)
    with caplog.at_level(logging.INFO, logger="appliance.daemon.diskkv"):
        tier.discard("never-written", None)  # an agent that never spilled unregisters
        assert caplog.records == []
        tier.write("a", VALID, TOKENS, STATE, last_used=0.0)
        tier.discard("a", "unregistered")
        assert not tier.path("a").exists() and not tier.holds("a")
        assert [r.getMessage() for r in caplog.records] == ["disk KV: agent a's state deleted (unregistered)"]
        caplog.clear()
        tier.path("b").mkdir(parents=True)  # a folder where the file would be: the delete fails
        tier.discard("b", None)
        assert [r.levelname for r in caplog.records] == ["WARNING"]
        assert "disk KV: cannot delete" in caplog.text


def test_start_up_keeps_the_restored_agents_files_and_deletes_orphans_and_temporaries(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    tier = DiskTier(folder, budget=10**8)
    for key in ("a", "b"):
        tier.write(key, VALID, TOKENS, STATE, last_used=0.0)
    (folder / ".a.kv.x1y2.tmp").write_bytes(b"half")
    again = DiskTier(folder, budget=None)
    assert sorted(again.files) == ["a", "b"]
    assert not (folder / ".a.kv.x1y2.tmp").exists()
    assert again.budget >= again.held_bytes  # auto: a share of the free space plus what it holds
    assert again.adopt(["a"], {"a": 5.0}) == ["b"]
    assert sorted(p.name for p in folder.iterdir()) == ["a.kv"]
    assert again.files["a"].last_used == 5.0


def test_a_failed_write_degrades_the_tier_until_a_probe_succeeds(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    tier = DiskTier(tmp_path / "kv", budget=10**8)
    real_write = kvfiles.write

    def full(*args: object, **kwargs: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(kvfiles, "write", full)
    written, _ = tier.write("a", VALID, TOKENS, STATE, last_used=0.0)
    assert not written
    report = tier.report()
    assert report["status"] == "degraded"
    assert report["errno"] == "ENOSPC"
    monkeypatch.setattr(kvfiles, "write", real_write)
    tier.probe()
    assert tier.report()["status"] == "ok"
    assert diskkv.auto_budget(4000, 10) == 1010
