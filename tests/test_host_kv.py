"""The host RAM budget for parked KV state (``host_kv_budget``): the pure drop policy, the daemon keeping to it on
a fake engine, and a dropped agent continuing exactly on the real tiny model."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from appliance.config.validate import Config, parse_config
from appliance.daemon.core import Daemon, DecodeResult, physical_memory
from appliance.daemon.devices import FakeDevice
from appliance.daemon.hostkv import (
    HeldState,
    auto_budget,
    held_bytes,
    meminfo_total,
    parked_estimate,
    per_token,
    to_drop,
)
from appliance.engine.fake import FakeEngine, ManualClock, fresh_text
from appliance.engine.interface import Conversation
from appliance.engine.slots import Slots
from appliance.server.lines import status_body

# -- the pure policy ------------------------------------------------------------------------------------------


def held(key: str, nbytes: int, last_used: float, *, parked: bool = True) -> HeldState:
    return HeldState(key, nbytes, parked, last_used)


def test_nothing_is_dropped_while_it_fits() -> None:
    states = [held("a", 100, 1.0), held("b", 100, 2.0), held("live", 50, 3.0, parked=False)]
    assert held_bytes(states) == 250
    assert to_drop(states, 250) == [] and to_drop([], 0) == []


def test_reuse_buffers_go_first_then_the_least_recently_used_parked_states() -> None:
    states = [held("new", 100, 9.0), held("old", 100, 1.0), held("mid", 100, 5.0),
              held("live", 60, 0.5, parked=False), held("live2", 40, 10.0, parked=False)]
    assert held_bytes(states) == 400 and to_drop(states, 400) == []
    assert to_drop(states, 399) == ["live"]  # a reuse buffer first, even the most recently used one
    assert to_drop(states, 300) == ["live", "live2"]
    assert to_drop(states, 299) == ["live", "live2", "old"]
    assert to_drop(states, 100) == ["live", "live2", "old", "mid"]
    assert to_drop(states, 0) == ["live", "live2", "old", "mid", "new"]  # a zero budget keeps nothing


def test_a_state_larger_than_the_budget_is_dropped_too_and_empty_buffers_are_skipped() -> None:
    assert to_drop([held("huge", 1000, 5.0)], 999) == ["huge"]
    assert to_drop([held("empty", 0, 0.0), held("x", 10, 1.0)], 5) == ["x"]


def test_the_state_being_attached_goes_last() -> None:
    states = [held("a", 100, 1.0), held("b", 100, 2.0), held("live", 10, 0.0, parked=False)]
    assert to_drop(states, 110, frozenset({"a"})) == ["live", "b"]
    assert to_drop(states, 0, frozenset({"a"})) == ["live", "b", "a"]


def test_the_estimate_bounds_a_saved_state_of_kv_plus_a_header_smaller_than_a_token() -> None:
    header, row = 120, 4108  # llama.cpp's state of the real tiny model: 120 bytes + 4,108 a token
    for seen in (1, 3, 500):  # whatever conversation the ratio was learned from
        ratio = per_token(header + row * seen, seen)
        for n in (0, 1, 2, 3, 50, 1000):
            assert header + row * n <= parked_estimate(ratio, n, 0) <= 1.05 * (header + row * (n + 1))
    assert parked_estimate(4, 10, 10**6) == 10**6  # a larger buffer is reused by the save, and kept
    assert parked_estimate(0, 10, 0) == 0 and per_token(100, 0) == 0 and per_token(10, 3) == 4


def test_ties_in_age_break_by_key_so_the_order_is_stable() -> None:
    assert to_drop([held("b", 10, 1.0), held("a", 10, 1.0)], 10) == ["a"]


MEMINFO = "MemFree:         1000 kB\nMemTotal:       16384000 kB\nSwapTotal: 0 kB\n"


@pytest.mark.parametrize(("text", "want"), [
    (MEMINFO, 16384000 * 1024),
    ("MemTotal: 4096\n", 4096),  # no unit: bytes
    ("MemFree: 1 kB\n", None),  # not there
    ("MemTotal: lots kB\n", None),
    ("MemTotal: ١٢ kB\n", None),  # non-ASCII digits are not a number
    ("", None),
])
def test_meminfo_total(text: str, want: int | None) -> None:
    assert meminfo_total(text) == want


def test_the_auto_budget_is_a_quarter_of_physical_ram() -> None:
    assert auto_budget(16 * 1024**3) == 4 * 1024**3
    assert physical_memory() > 0


# -- the daemon on a fake engine --------------------------------------------------------------------------------

def make_config(tmp_path: Path, **extra: Any) -> Config:
    doc: dict[str, Any] = {
        "data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "model_dirs": [str(tmp_path)],
        "resync_interval_s": 0, "engine": {"live_slots": 1},
        "models": [{"name": name, "path": str(tmp_path / f"{name}.gguf"), "vram_bytes": "1GiB"}
                   for name in ("m", "other")],
    }
    doc.update(extra)
    return parse_config(yaml.safe_dump(doc), base_dir=tmp_path, check_files=False)


STATE = 4 * (1 + 6 + 7)  # a fake conversation of a 6-character prompt and 8 tokens, parked: 14 tokens evaluated


def test_the_daemon_drops_the_least_recently_used_parked_state_and_never_refuses(
        tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    config = make_config(tmp_path, host_kv_budget=2 * STATE + 8)  # room for two parked states, not three
    engine, clock = FakeEngine(), ManualClock()
    daemon = Daemon(config, FakeDevice("8GiB", process_used=0), engine, clock=clock)
    seen: list[dict[str, int]] = []
    during_swaps: list[int] = []  # bytes held right after each save, before any drop that follows it
    park = Slots._park

    def watched_park(slots: Slots, seq_id: int) -> Conversation:
        conv = park(slots, seq_id)
        during_swaps.append(sum(len(a.conversation.buffer or b"") for a in daemon.agents.values()))
        return conv

    monkeypatch.setattr(Slots, "_park", watched_park)

    async def decode(agent: str, prompt: str) -> DecodeResult:
        clock.advance(1)
        result = await daemon.decode(agent, 8, prompt)
        seen.append(daemon.snapshot()["host_kv"])
        return result

    async def main() -> None:
        try:
            for name in "abcde":
                await daemon.register(name, "m")
            await daemon.register("x", "other")  # another model's agents share the same budget
            first = {name: await decode(name, f"Agent{name}") for name in "abcd"}
            assert [first[name].dropped for name in "abcd"] == [(), (), (), ("a",)]
            x = await decode("x", "Agentx")  # other model: evicts nobody, parks nothing
            assert x.dropped == () and x.evicted is None
            e = await decode("e", "Agente")  # parks d: b, c, d do not fit, b is the least recently used
            assert e.dropped == ("b",)
            again = await decode("a", "")  # a comes back: rebuilt from its tokens, the same continuation
            assert again.rebuilt and not again.restored and again.evicted == "e" and again.dropped == ("c",)
            assert first["a"].generation.text + again.generation.text == fresh_text("Agenta", 16)
            c = await decode("c", "")  # parks a, now 22 tokens long: d, e, a do not fit, nor do e and a
            assert c.rebuilt and c.dropped == ("d", "e") and c.generation.text == fresh_text("Agentc", 16)[8:]
            a_3 = await decode("a", "")  # a (88 bytes) and c (88) do not fit together: a is rebuilt, not restored
            assert a_3.rebuilt and not a_3.restored and a_3.dropped == ("a",) and a_3.evicted == "c"
            assert a_3.generation.text == fresh_text("Agenta", 24)[16:]
            states = {a["id"]: a["state"] for a in daemon.snapshot()["agents"]}
            assert [a for a, where in states.items() if where == "host"] == ["c"]
            assert states["b"] == states["d"] == states["e"] == "empty"  # dropped, their tokens kept
            assert len(daemon.agents["d"].conversation.tokens) == 1 + 6 + 8
            assert daemon.counters["host_kv_drops"] == 6 and daemon.counters["host_kv_rebuilds"] == 3
        finally:
            await daemon.close()

    caplog.set_level(logging.INFO, logger="appliance.daemon.core")
    asyncio.run(asyncio.wait_for(main(), 30))
    assert max(s["parked_bytes"] for s in seen) <= 2 * STATE + 8  # never above the budget between decodes
    assert len(during_swaps) == 7 and max(during_swaps) <= 2 * STATE + 8  # room was made before each swap
    assert max(s["parked_agents"] for s in seen) == 2
    last = seen[-1]
    assert last["budget_bytes"] == 2 * STATE + 8 and last["drops"] == 6 and last["rebuilds"] == 3
    drops = [r.getMessage() for r in caplog.records if "host KV: dropped" in r.getMessage()]
    assert len(drops) == 6
    assert drops[0].startswith(f"host KV: dropped agent a's parked state ({STATE} bytes; budget {2 * STATE + 8}")


def test_reuse_buffers_go_before_any_parked_state_and_the_budget_is_read_at_use_time(tmp_path: Path) -> None:
    # The fixed strategy: a restored conversation keeps its buffer for reuse (an adaptive pool's lets it go).
    engine = {"live_slots": 1, "adaptive": False}
    config = make_config(tmp_path, host_kv_budget=2 * STATE + 8, engine=engine)
    daemon = Daemon(config, FakeDevice("8GiB", process_used=0), FakeEngine(), clock=ManualClock())

    async def main() -> None:
        try:
            for agent, model in (("p", "other"), ("q", "other"), ("a", "m"), ("b", "m")):
                await daemon.register(agent, model)
            await daemon.decode("p", 8, "Agentp")
            await daemon.decode("q", 8, "Agentq")  # parks p
            back = await daemon.decode("p", 8, "")  # restores p, parks q: p keeps its buffer for reuse
            assert back.restored and back.dropped == ()
            assert daemon.snapshot()["host_kv"]["parked_bytes"] == 2 * STATE
            await daemon.decode("a", 8, "Agenta")
            b = await daemon.decode("b", 8, "Agentb")  # parks a: over budget, p's reuse buffer goes, no state
            assert b.dropped == () and daemon.agents["p"].conversation.buffer is None
            assert daemon.agents["q"].conversation.where == daemon.agents["a"].conversation.where == "host"
            assert daemon.snapshot()["host_kv"]["parked_bytes"] == 2 * STATE
            # A reload: the next swap reads the new budget.
            daemon.config = make_config(tmp_path, host_kv_budget=STATE, engine=engine)
            a = await daemon.decode("a", 8, "")
            assert a.dropped == ("q", "a") and a.rebuilt  # room for b's state: q, then a itself
            host = daemon.snapshot()["host_kv"]
            assert host["budget_bytes"] == STATE and host["parked_bytes"] == STATE and host["parked_agents"] == 1
        finally:
            await daemon.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_zero_budget_keeps_no_parked_state_and_decodes_go_on(tmp_path: Path) -> None:
    config = make_config(tmp_path, host_kv_budget=0)
    daemon = Daemon(config, FakeDevice("8GiB", process_used=0), FakeEngine(), clock=ManualClock())

    async def main() -> None:
        try:
            await daemon.register("a", "m")
            await daemon.register("b", "m")
            texts = {"a": "", "b": ""}
            for _ in range(3):
                for name in "ab":
                    result = await daemon.decode(name, 4, f"Agent{name}" if not texts[name] else "")
                    texts[name] += result.generation.text
                    assert daemon.snapshot()["host_kv"]["parked_bytes"] == 0
            assert texts == {"a": fresh_text("Agenta", 12), "b": fresh_text("Agentb", 12)}
            assert daemon.counters["host_kv_drops"] == 5 and daemon.counters["kv_restores"] == 0
        finally:
            await daemon.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_a_cold_request_returns_only_once_its_parked_state_fits_the_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A request longer than the hot pool runs in a cold context; when it ends its conversation is parked beside
    the others and the budget is fitted by an engine job. The decode returns after that job, so that no reader
    (STATUS, health, the next request) sees parked state over the budget: here the job is slowed down."""
    config = make_config(tmp_path, host_kv_budget=0,
                         engine={"live_slots": 1, "warmup_runs": 0, "async_switch": False},  # else the pool grows
                         models=[{"name": "m", "path": str(tmp_path / "m.gguf"), "vram_bytes": "1GiB",
                                  "n_ctx": 2048}])
    daemon = Daemon(config, FakeDevice("8GiB", process_used=0), FakeEngine(), clock=ManualClock())
    fit = Daemon.fit_host_kv

    def slow_fit(self: Daemon) -> list[str]:
        time.sleep(0.3)
        return fit(self)

    monkeypatch.setattr(Daemon, "fit_host_kv", slow_fit)

    async def main() -> None:
        try:
            await daemon.register("long", "m")
            result = await daemon.decode("long", 4, "x" * 1200)  # past the 512-cell hot pool: cold
            assert result.plan == "L" and daemon.adaptive.colds == 1
            assert daemon.snapshot()["host_kv"]["parked_bytes"] == 0
            assert daemon.counters["host_kv_drops"] == 1
            again = await daemon.decode("long", 4, "")  # re-evaluated from its tokens: the same text
            assert again.rebuilt and again.generation.text == fresh_text("x" * 1200, 8)[4:]
        finally:
            await daemon.close()

    asyncio.run(asyncio.wait_for(main(), 30))


def test_the_budget_is_auto_by_default_and_shown_next_to_the_ledger(tmp_path: Path) -> None:
    daemon = Daemon(make_config(tmp_path), FakeDevice("8GiB", process_used=0), FakeEngine(), clock=ManualClock())
    try:
        snapshot = daemon.snapshot()
        assert snapshot["host_kv"] == {"budget_bytes": physical_memory() // 4, "parked_bytes": 0,
                                       "parked_agents": 0, "drops": 0, "rebuilds": 0, "spills": 0}
        body = status_body(snapshot)
        ledger = next(i for i, line in enumerate(body) if line.startswith("ledger "))
        assert body[ledger + 1] == (f"host_kv budget_bytes={physical_memory() // 4} parked_bytes=0 "
                                    "parked_agents=0 drops=0 rebuilds=0 spills=0")
    finally:
        asyncio.run(daemon.close())


# -- the real tiny model --------------------------------------------------------------------------------------

def test_a_dropped_agent_continues_as_it_would_have_on_the_real_model(tmp_path: Path, tiny_model: Path) -> None:
    from appliance.engine.runtime import Engine

    doc = {"data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "model_dirs": [str(tiny_model.parent)],
           "resync_interval_s": 0, "host_kv_budget": 1, "engine": {"live_slots": 1},
           "models": [{"name": "tiny", "path": str(tiny_model), "n_ctx": 256}]}
    config = parse_config(yaml.safe_dump(doc), base_dir=tmp_path)
    daemon = Daemon(config, FakeDevice("8GiB", process_used=0), Engine(1))
    prompt = "Once upon a time, in a land far away"

    async def main() -> None:
        try:
            for name in ("ref", "a", "b"):
                await daemon.register(name, "tiny")
            ref_1 = await daemon.decode("ref", 12, prompt)
            ref_2 = await daemon.decode("ref", 12, " and")  # undisturbed: stays live in the context
            a_1 = await daemon.decode("a", 12, prompt)  # evicts ref: parked, then dropped
            assert a_1.evicted == "ref" and a_1.dropped == ("ref",)
            b_1 = await daemon.decode("b", 12, "Something else entirely")
            assert b_1.evicted == "a" and b_1.dropped == ("a",)
            a_2 = await daemon.decode("a", 12, " and")
            assert a_2.rebuilt and not a_2.restored
            assert (a_1.generation.tokens, a_2.generation.tokens) == (ref_1.generation.tokens,
                                                                      ref_2.generation.tokens)
            assert a_2.generation.text == ref_2.generation.text
            assert daemon.snapshot()["host_kv"]["parked_bytes"] <= 1
        finally:
            await daemon.close()

    asyncio.run(asyncio.wait_for(main(), 120))
