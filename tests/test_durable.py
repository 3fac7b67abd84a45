"""Durable agents on the fake engine, a driven clock and a real SQLite store: what is committed when, what a start-up
brings back (dormant, its idle time kept), the disk tier between host RAM and re-evaluation, and every fallback (a
removed model, a changed file, a bad KV file, a store that cannot be written)."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest
import yaml

from appliance.config.validate import Config, parse_config
from appliance.daemon.core import Daemon
from appliance.daemon.devices import FakeDevice
from appliance.daemon.diskkv import DiskTier
from appliance.daemon.store import AgentStore, StoreWriter
from appliance.engine.fake import FakeEngine, ManualClock, fresh_text

MODELS = ("m", "other")


def make_config(tmp_path: Path, models: tuple[str, ...] = MODELS, **extra: Any) -> Config:
    for name in models:
        path = tmp_path / f"{name}.gguf"
        if not path.exists():
            path.write_bytes(b"GGUF" + name.encode())  # a real file: its identity is what a KV file is valid for
    doc: dict[str, Any] = {
        "data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "model_dirs": [str(tmp_path)],
        "resync_interval_s": 0, "engine": {"live_slots": 1},
        "models": [{"name": name, "path": str(tmp_path / f"{name}.gguf"), "vram_bytes": "1GiB"} for name in models],
    }
    doc.update(extra)
    return parse_config(yaml.safe_dump(doc), base_dir=tmp_path, check_files=False)


class Box:
    """One appliance's lifetime on a state folder: a daemon with a store and a disk tier, started and stopped as
    ``appliance run`` does."""

    def __init__(self, tmp_path: Path, config: Config, *, wall: list[float], engine: FakeEngine | None = None,
                 disk_budget: int | None = 10**8) -> None:
        self.state = tmp_path / "state"
        self.state.mkdir(exist_ok=True)
        self.clock = ManualClock()
        self.wall = wall
        self.engine = engine or FakeEngine()
        self.daemon = Daemon(config, FakeDevice("8GiB", process_used=0), self.engine, clock=self.clock,
                             wall=self.now)
        store, _ = AgentStore.open(self.state / "agents.db")
        self.records = store.load_agents()
        responses = store.load_responses()
        disk = None if disk_budget == 0 else DiskTier(self.state / "kv", disk_budget)
        self.daemon.attach_durability(StoreWriter(store), disk)
        self.restored = self.daemon.restore(self.records, responses)

    def now(self) -> float:
        return self.wall[0]

    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.wall[0] += seconds

    async def stop(self, *, write_out: bool = True) -> None:
        """SIGTERM's path (with the write-out), or a crash's (the store as it is, nothing more written)."""
        await self.daemon.close(deadline=asyncio.get_running_loop().time() + 60 if write_out else None)

    def stored(self) -> dict[str, tuple[int, ...]]:
        db = AgentStore(self.state / "agents.db")
        try:
            return {record.id: record.tokens for record in db.load_agents()}
        finally:
            db.close()


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_registrations_and_finished_decodes_are_committed_before_they_return(tmp_path: Path) -> None:
    wall = [1e9]
    config = make_config(tmp_path)

    async def main() -> None:
        box = Box(tmp_path, config, wall=wall)
        await box.daemon.register("a", "m")
        assert box.stored() == {"a": ()}
        await box.daemon.decode("a", 8, "Hello")
        assert len(box.stored()["a"]) == 1 + 5 + 8 - 1 or len(box.stored()["a"]) == 1 + 5 + 8
        assert box.stored()["a"] == tuple(box.daemon.agents["a"].conversation.tokens)
        await box.daemon.register("session", "m", owner=object())  # a MAGN session's agent: never stored
        await box.daemon.decode("session", 4, "Hi")
        assert set(box.stored()) == {"a"}
        await box.daemon.unregister("a")
        assert box.stored() == {}
        await box.stop()

    run(main())


def test_a_cancelled_decode_commits_nothing(tmp_path: Path) -> None:
    wall = [1e9]
    config = make_config(tmp_path)

    async def main() -> None:
        box = Box(tmp_path, config, wall=wall)
        await box.daemon.register("a", "m")
        await box.daemon.decode("a", 4, "Hello")
        before = box.stored()["a"]
        cancel = __import__("threading").Event()
        seen: list[object] = []

        def on_token(token: object) -> None:
            seen.append(token)
            if len(seen) == 2:
                cancel.set()

        result = await box.daemon.decode("a", 50, " more", on_token=on_token, cancel=cancel)
        assert result.generation.stop_reason == "cancelled"
        assert box.stored()["a"] == before == tuple(box.daemon.agents["a"].conversation.tokens)
        await box.stop()

    run(main())


def test_a_restart_brings_agents_back_dormant_and_they_continue_exactly(tmp_path: Path) -> None:
    wall = [1e9]
    config = make_config(tmp_path)

    async def first() -> None:
        box = Box(tmp_path, config, wall=wall)
        for name, model in (("a", "m"), ("b", "m"), ("x", "other")):
            await box.daemon.register(name, model)
            await box.daemon.decode(name, 8, f"Agent{name}")
        await box.stop()  # SIGTERM: every live and parked state goes to disk

    async def second() -> None:
        box = Box(tmp_path, config, wall=wall)
        assert box.restored == 3
        assert all(agent.dormant for agent in box.daemon.agents.values())
        assert {m.key: m.refcount for m in box.daemon.models.values() if m.runtime is not None} == {}  # none loaded
        assert {a["id"]: a["state"] for a in box.daemon.snapshot()["agents"]} == {"a": "disk", "b": "disk",
                                                                                 "x": "disk"}
        for name in ("a", "b", "x"):
            result = await box.daemon.decode(name, 8, "")
            assert result.restored_from == "disk", name
            assert result.generation.text == fresh_text(f"Agent{name}", 16)[8:], name
        assert box.daemon.models["m"].refcount == 2 and box.daemon.models["other"].refcount == 1
        assert box.daemon.counters["restored_from_disk"] == 3
        await box.stop()

    run(first())
    run(second())


def test_a_crash_keeps_the_committed_tokens_and_the_agent_re_evaluates_them(tmp_path: Path) -> None:
    wall = [1e9]
    config = make_config(tmp_path)

    async def first() -> None:
        box = Box(tmp_path, config, wall=wall)
        await box.daemon.register("a", "m")
        await box.daemon.decode("a", 8, "Agenta")
        await box.stop(write_out=False)  # kill -9: no write-out (its state was on the device only)

    async def second() -> None:
        box = Box(tmp_path, config, wall=wall)
        result = await box.daemon.decode("a", 8, "")
        assert result.restored_from == "tokens" and result.rebuilt
        assert result.generation.text == fresh_text("Agenta", 16)[8:]
        await box.stop()

    run(first())
    run(second())


def test_idle_time_counts_across_the_restart(tmp_path: Path) -> None:
    wall = [1e9]
    config = make_config(tmp_path, agent_idle_ttl_s=100)

    async def first() -> None:
        box = Box(tmp_path, config, wall=wall)
        await box.daemon.register("old", "m")
        box.advance(60)
        await box.daemon.register("new", "m")
        await box.stop()

    async def second() -> None:
        wall[0] += 30  # down for 30 s: old was last used 90 s ago, new 30 s ago
        box = Box(tmp_path, config, wall=wall)
        box.advance(15)
        assert await box.daemon.expire_agents() == ["old"]
        assert set(box.daemon.agents) == {"new"} and set(box.stored()) == {"new"}
        assert box.daemon.models["m"].refcount == 0  # a dormant agent held no model: nothing to give back
        await box.stop()

    run(first())
    run(second())


def test_an_agent_whose_model_left_the_config_is_not_restored(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    wall = [1e9]

    async def first() -> None:
        box = Box(tmp_path, make_config(tmp_path), wall=wall)
        await box.daemon.register("a", "m")
        await box.daemon.register("x", "other")
        await box.daemon.decode("x", 4, "Hi")
        await box.stop()

    async def second() -> None:
        box = Box(tmp_path, make_config(tmp_path, models=("m",)), wall=wall)
        assert set(box.daemon.agents) == {"a"}
        await box.stop()
        assert set(box.stored()) == {"a"}
        assert not (tmp_path / "state" / "kv" / "x.kv").exists()

    run(first())
    run(second())
    assert "agent x not restored: its model other is gone" in caplog.text


def test_a_changed_model_file_keeps_the_tokens_with_the_same_vocabulary_and_resets_them_with_another(
        tmp_path: Path) -> None:
    wall = [1e9]
    config = make_config(tmp_path)

    async def first() -> None:
        box = Box(tmp_path, config, wall=wall)
        for name, model in (("a", "m"), ("x", "other")):
            await box.daemon.register(name, model)
            await box.daemon.decode(name, 8, f"Agent{name}")
        await box.stop()

    async def second() -> None:
        (tmp_path / "m.gguf").write_bytes(b"GGUF replaced, same vocabulary")
        (tmp_path / "other.gguf").write_bytes(b"GGUF replaced, another vocabulary")
        engine = FakeEngine()
        engine.set_vocabulary("other.gguf", "another-vocabulary")
        box = Box(tmp_path, config, wall=wall, engine=engine)
        a = await box.daemon.decode("a", 8, "")
        assert a.restored_from == "tokens"  # its KV file was made for the old file: discarded
        assert a.generation.text == fresh_text("Agenta", 16)[8:]
        assert a.notice is None
        x = await box.daemon.decode("x", 8, "Agentx")
        assert x.notice is not None and "different vocabulary" in x.notice
        assert x.generation.text == fresh_text("Agentx", 8)  # a fresh conversation
        assert not (tmp_path / "state" / "kv" / "a.kv").exists()
        await box.stop()

    run(first())
    run(second())


@pytest.mark.parametrize(("before", "after", "restored_from"),
                         [(False, "auto", "tokens"), (True, False, "tokens"), ("auto", True, "disk"),
                          (False, False, "disk")])
def test_a_kv_file_comes_back_only_into_the_v_layout_it_was_saved_with(
        tmp_path: Path, before: object, after: object, restored_from: str) -> None:
    """engine.flash_attention decides the V cache's layout (transposed only when it is false; auto and true store
    it alike): a KV file saved under the other layout is discarded and the tokens re-evaluated, never handed to
    llama.cpp (which would refuse it)."""
    wall = [1e9]

    async def start(setting: object, prompt: str) -> Any:
        box = Box(tmp_path, make_config(tmp_path, engine={"live_slots": 1, "flash_attention": setting}), wall=wall)
        if prompt:
            await box.daemon.register("a", "m")
        result = await box.daemon.decode("a", 8, prompt)
        await box.stop()
        return result

    run(start(before, "Agenta"))
    assert (tmp_path / "state" / "kv" / "a.kv").exists()
    again = run(start(after, ""))
    assert again.restored_from == restored_from
    assert again.generation.text == fresh_text("Agenta", 16)[8:]


@pytest.mark.parametrize(("loaded", "changed", "restart", "restored_from"),
                         [("auto", False, False, "tokens"), (False, "auto", True, "tokens"),
                          (False, "auto", False, "disk"), (True, False, "auto", "disk")])
def test_a_kv_file_says_the_layout_its_state_was_saved_in_after_a_live_change(
        tmp_path: Path, loaded: object, changed: object, restart: object, restored_from: str) -> None:
    """A reload that changes engine.flash_attention applies to models loaded after it: the loaded model still saves
    its old layout, and its KV files say so. A restart under the other layout re-evaluates the tokens (the fake
    refuses a state of the other layout as llama.cpp does: INTERNAL, had it been loaded); one under the layout the
    state was saved in restores it."""
    wall = [1e9]

    async def first() -> None:
        box = Box(tmp_path, make_config(tmp_path, engine={"live_slots": 1, "flash_attention": loaded}), wall=wall)
        await box.daemon.register("a", "m")
        await box.daemon.decode("a", 8, "Agenta")
        box.daemon.apply_config(make_config(tmp_path, engine={"live_slots": 1, "flash_attention": changed}))
        await box.stop()

    async def second() -> Any:
        box = Box(tmp_path, make_config(tmp_path, engine={"live_slots": 1, "flash_attention": restart}), wall=wall)
        result = await box.daemon.decode("a", 8, "")
        await box.stop()
        return result

    run(first())
    again = run(second())
    assert again.restored_from == restored_from
    assert again.generation.text == fresh_text("Agenta", 16)[8:]


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage", "other-tokens"])
def test_a_bad_kv_file_falls_back_to_the_tokens(tmp_path: Path, damage: str,
                                               caplog: pytest.LogCaptureFixture) -> None:
    wall = [1e9]
    config = make_config(tmp_path)

    async def first() -> None:
        box = Box(tmp_path, config, wall=wall)
        for name in ("a", "b"):
            await box.daemon.register(name, "m")
            await box.daemon.decode(name, 8, f"Agent{name}")
        await box.stop()

    async def second() -> None:
        path = tmp_path / "state" / "kv" / "a.kv"
        data = path.read_bytes()
        if damage == "flip":
            path.write_bytes(data[:-3] + bytes([data[-3] ^ 0x40]) + data[-2:])
        elif damage == "truncate":
            path.write_bytes(data[:-4])
        elif damage == "garbage":
            path.write_bytes(b"\0" * len(data))
        else:
            path.write_bytes((tmp_path / "state" / "kv" / "b.kv").read_bytes())  # another agent's valid file
        box = Box(tmp_path, config, wall=wall)
        a = await box.daemon.decode("a", 8, "")
        assert a.restored_from == "tokens"
        assert a.generation.text == fresh_text("Agenta", 16)[8:]  # never a wrong continuation
        b = await box.daemon.decode("b", 8, "")
        assert b.restored_from == "disk"
        assert b.generation.text == fresh_text("Agentb", 16)[8:]
        await box.stop()

    run(first())
    run(second())
    assert "disk KV: agent a's file" in caplog.text and "is discarded" in caplog.text


def test_parked_state_past_the_host_budget_goes_to_disk_and_comes_back(tmp_path: Path) -> None:
    wall = [1e9]
    state = 4 * (1 + 6 + 7)  # a fake conversation of a 6-character prompt and 8 tokens, parked
    config = make_config(tmp_path, host_kv_budget=2 * state + 8)  # two parked states in host RAM, not three

    async def main() -> None:
        box = Box(tmp_path, config, wall=wall)
        for name in "abcd":
            await box.daemon.register(name, "m")
            box.advance(1)
            await box.daemon.decode(name, 8, f"Agent{name}")
        # d's decode parked c, and a (the least recently used) went to disk rather than being dropped
        assert box.daemon.agents["a"].conversation.where == "disk"
        assert (tmp_path / "state" / "kv" / "a.kv").exists()
        assert box.daemon.counters["disk_kv_spills"] >= 1 and box.daemon.counters["host_kv_drops"] == 0
        a = await box.daemon.decode("a", 8, "")
        assert a.restored_from == "disk" and a.restored and not a.rebuilt
        assert a.generation.text == fresh_text("Agenta", 16)[8:]
        b = await box.daemon.decode("b", 8, "")  # from disk, or re-evaluated: a's longer state leaves no room
        assert b.generation.text == fresh_text("Agentb", 16)[8:]
        await box.stop()

    run(main())


def test_without_a_disk_tier_parked_state_past_the_budget_is_dropped_as_before(tmp_path: Path) -> None:
    wall = [1e9]
    state = 4 * (1 + 6 + 7)
    config = make_config(tmp_path, host_kv_budget=state + 8)

    async def main() -> None:
        box = Box(tmp_path, config, wall=wall, disk_budget=0)
        for name in "abc":
            await box.daemon.register(name, "m")
            box.advance(1)
            await box.daemon.decode(name, 8, f"Agent{name}")
        assert box.daemon.counters["host_kv_drops"] == 1
        a = await box.daemon.decode("a", 8, "")
        assert a.restored_from == "tokens"
        assert a.generation.text == fresh_text("Agenta", 16)[8:]
        await box.stop()

    run(main())


class FullStore(AgentStore):
    """A store whose transactions fail as on a full disk while ``full`` is set."""

    full = False

    def apply(self, writes: Any) -> None:
        if FullStore.full:
            raise sqlite3.OperationalError("database or disk is full")
        super().apply(writes)


def test_a_store_that_cannot_be_written_fails_no_request_and_catches_up(tmp_path: Path) -> None:
    wall = [1e9]
    config = make_config(tmp_path)

    async def main() -> None:
        box = Box(tmp_path, config, wall=wall)
        store = FullStore(tmp_path / "state" / "agents.db")
        writer = StoreWriter(store, first_retry_s=0.01, max_retry_s=0.05)
        box.daemon.attach_durability(writer, box.daemon.disk)
        FullStore.full = True
        try:
            await box.daemon.register("a", "m")
            result = await box.daemon.decode("a", 8, "Agenta")
            assert result.generation.text == fresh_text("Agenta", 8)
            report = box.daemon.durability()["store"]
            assert report["status"] == "degraded" and report["errno"] == "ENOSPC"
        finally:
            FullStore.full = False
        for _ in range(300):
            if writer.report()["status"] == "ok" and writer.report()["pending"] == 0:
                break
            await asyncio.sleep(0.01)
        assert box.stored() == {"a": tuple(box.daemon.agents["a"].conversation.tokens)}
        await box.stop()

    run(main())


def test_max_agents_keeps_the_most_recently_used_at_restore(tmp_path: Path) -> None:
    wall = [1e9]

    async def first() -> None:
        box = Box(tmp_path, make_config(tmp_path), wall=wall)
        for name in ("old", "mid", "new"):
            await box.daemon.register(name, "m")
            box.advance(10)
        await box.stop()

    async def second() -> None:
        box = Box(tmp_path, make_config(tmp_path, max_agents=2), wall=wall)
        assert set(box.daemon.agents) == {"mid", "new"}
        await box.stop()
        assert set(box.stored()) == {"mid", "new"}

    run(first())
    run(second())
