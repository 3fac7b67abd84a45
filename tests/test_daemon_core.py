"""The daemon core on a fake engine, a fake device and a hand-driven clock: no model, no llama.cpp, no sleeping.

Every wait is on something that happens (a gate arrival, a task finishing); ``time.sleep`` is forbidden in this
module (see the ``no_sleep`` fixture). The real end-to-end tests (tests/test_daemon.py) stay: these add fast ones.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from appliance.app import sweep_period
from appliance.config.validate import Config, parse_config
from appliance.daemon.core import Daemon
from appliance.daemon.devices import FakeDevice
from appliance.engine.fake import FakeEngine, Gate, ManualClock, fresh_text
from appliance.engine.interface import EngineProtocol, RuntimeProtocol, Sampling, Token
from appliance.errors import ApplianceError

GiB = 1024**3


@pytest.fixture(autouse=True)
def no_sleep(monkeypatch: pytest.MonkeyPatch) -> None:
    def forbidden(seconds: float) -> None:
        raise AssertionError(f"time.sleep({seconds}) in a daemon core test")

    monkeypatch.setattr(time, "sleep", forbidden)


def make_config(tmp_path: Path, models: dict[str, dict[str, Any]], **extra: Any) -> Config:
    """Models named ``name`` at ``<tmp>/<name>.gguf`` (files need not exist: the fake engine never opens them)."""
    doc: dict[str, Any] = {
        "data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "model_dirs": [str(tmp_path)],
        "resync_interval_s": 0,
        "engine": {"warmup_runs": 0},  # the fake engine counts every token: no warm-up runs beside the tests' own
        "models": [{"name": name, "path": str(tmp_path / f"{name}.gguf"), "vram_bytes": "1GiB", **spec}
                   for name, spec in models.items()],
    }
    doc.update(extra)
    return parse_config(yaml.safe_dump(doc), base_dir=tmp_path, check_files=False)


@dataclass
class Env:
    daemon: Daemon
    engine: FakeEngine
    clock: ManualClock
    device: FakeDevice


def run(tmp_path: Path, body: Callable[[Env], Awaitable[None]], models: dict[str, dict[str, Any]] | None = None,
        timeout: float = 30, **extra: Any) -> Env:
    """Build a daemon on a FakeEngine, run ``body`` on a fresh event loop, then close the daemon."""
    config = make_config(tmp_path, {"m": {}} if models is None else models, **extra)
    engine, clock, device = FakeEngine(), ManualClock(), FakeDevice("8GiB", process_used=0)
    env = Env(Daemon(config, device, engine, clock=clock), engine, clock, device)

    async def main() -> None:
        try:
            await body(env)
        finally:
            engine.gate.open()
            engine.load_gate.open()
            engine.close_gate.open()
            await env.daemon.close()

    asyncio.run(asyncio.wait_for(main(), timeout))
    return env


async def error_of(awaitable: Awaitable[Any]) -> ApplianceError:
    with pytest.raises(ApplianceError) as info:
        await awaitable
    return info.value


# -- engine interface -----------------------------------------------------------------------------------------

def test_the_engines_satisfy_the_protocols(tmp_path: Path) -> None:
    engine: EngineProtocol = FakeEngine()
    runtime: RuntimeProtocol = engine.load(tmp_path / "x.gguf", n_ctx=64, n_gpu_layers=0)
    assert runtime.n_ctx == 64 and runtime.live == [] and runtime.live_slots == 1 and runtime.has_context
    engine.close()


def test_the_daemon_core_and_fake_engine_import_no_llama_cpp() -> None:
    code = "import sys, appliance.daemon.core, appliance.engine.fake; sys.exit('llama_cpp' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0


def test_manual_clock_and_gate_basics() -> None:
    clock = ManualClock(5.0)
    assert clock() == 5.0 and clock.advance(2.5) == 7.5 and clock() == 7.5
    with pytest.raises(ValueError):
        clock.advance(-1)
    gate = Gate(open=False)
    gate.release(2)
    assert gate.wait() and gate.wait()
    assert not gate.wait(timeout=0.01)  # no permit left
    assert not gate.wait(cancelled=lambda: True)  # a cancelled waiter leaves at once
    gate.open()
    assert gate.wait() and (gate.arrived, gate.passed, gate.held) == (5, 3, 0)


# -- models: refcounts, L4, L7 --------------------------------------------------------------------------------

def test_register_refcounts_and_the_last_unregister_unloads(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        changes: list[str] = []
        daemon.on_change = lambda: changes.append(daemon.model_state("m"))
        a = await daemon.register("a", "m")
        await daemon.register("b", "m")
        model = a.model
        assert model.refcount == 2 and model.state == "loaded" and len(engine.loads) == 1
        assert daemon.ledger.allocated == 1 * GiB and model.last_used == env.clock()
        assert (await error_of(daemon.register("a", "m"))).code == "AGENT_EXISTS"
        assert (await error_of(daemon.register("c", "ghost"))).code == "UNKNOWN_MODEL"
        await daemon.unregister("a")
        assert model.refcount == 1 and model.state == "loaded"
        await daemon.unregister("b")  # L4: the last one frees the model at once, no TTL involved
        assert model.refcount == 0 and model.state == "available" and model.runtime is None
        assert daemon.ledger.allocated == 0 and engine.live_runtimes == [] and engine.runtimes[0].closed
        assert changes == ["loaded", "available"]  # the registry file is rewritten on both
        assert (await error_of(daemon.unregister("b"))).code == "UNKNOWN_AGENT"
        await daemon.register("a", "m")  # and it loads again
        assert len(engine.loads) == 2 and daemon.model_state("m") == "loaded"

    run(tmp_path, body)


def test_idle_ttl_expires_when_the_clock_says_so(tmp_path: Path) -> None:
    models = {"m": {"idle_ttl_s": 60}, "forever": {"idle_ttl_s": 0}, "held": {"idle_ttl_s": 60}}

    async def body(env: Env) -> None:
        daemon, clock = env.daemon, env.clock
        await daemon.complete("m", 4, "Hi")  # anonymous use: loaded, no agent holds it
        await daemon.complete("forever", 4, "Hi")
        await daemon.register("agent", "held")
        assert daemon.model_state("m") == "loaded" and daemon.models["m"].refcount == 0
        clock.advance(59.9)
        assert await daemon.sweep_idle() == []
        await daemon.complete("m", 1, "Hi")  # use refreshes the idle timer
        clock.advance(59.9)
        assert await daemon.sweep_idle() == []
        clock.advance(0.1)
        assert await daemon.sweep_idle() == ["m"]
        assert daemon.model_state("m") == "available" and daemon.ledger.allocated == 2 * GiB
        clock.advance(1e6)  # a TTL of 0 never expires; an agent's model waits for its UNREGISTER (L4)
        assert await daemon.sweep_idle() == []
        assert daemon.model_state("forever") == daemon.model_state("held") == "loaded"

    run(tmp_path, body, models=models, agent_idle_ttl_s=0)  # the agent never expires: only its UNREGISTER frees "held"


def test_a_running_request_is_never_idle(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon, gate = env.daemon, env.engine.gate
        gate.close()
        job = asyncio.create_task(daemon.complete("m", 3, "Hi"))
        await gate.arrival(1)
        env.clock.advance(1e6)
        assert await daemon.sweep_idle() == [] and daemon.models["m"].inflight > 0
        gate.open()
        assert (await job).generation.text == fresh_text("Hi", 3)
        assert await daemon.sweep_idle() == []  # finishing counts as a use
        env.clock.advance(60)
        assert await daemon.sweep_idle() == ["m"]

    run(tmp_path, body, models={"m": {"idle_ttl_s": 60}})


# -- admission: ledger, failed loads, concurrent loads ---------------------------------------------------------

def test_the_ledger_denies_what_does_not_fit_and_loads_nothing(tmp_path: Path) -> None:
    models = {name: {"vram_bytes": int(2.3 * GiB)} for name in "abcd"}

    async def body(env: Env) -> None:
        daemon = env.daemon
        for name in "abc":
            await daemon.register(f"agent_{name}", name)
        error = await error_of(daemon.register("agent_d", "d"))
        assert error.code == "VRAM_LEDGER_DENY"
        assert [p.stem for p in env.engine.loads] == ["a", "b", "c"]  # d never reached the engine
        assert daemon.ledger.allocated == 3 * int(2.3 * GiB) <= daemon.ledger.cap
        assert daemon.model_state("d") == "available" and daemon.models["d"].refcount == 0
        assert daemon.counters["denials"] == 1 and "agent_d" not in daemon.agents
        await daemon.unregister("agent_a")
        await daemon.register("agent_d", "d")  # room again
        assert daemon.model_state("d") == "loaded"

    run(tmp_path, body, models=models, admission_percent=90)


def test_a_failed_load_rolls_the_reservation_back(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        await daemon.register("a", "m")
        before = daemon.ledger.snapshot()
        engine.fail_load("broken")
        error = await error_of(daemon.register("b", "broken"))
        assert error.code == "MODEL_LOAD_FAILED"
        after = daemon.ledger.snapshot()
        assert (after.allocated, dict(after.reservations)) == (before.allocated, dict(before.reservations))
        broken = daemon.models["broken"]
        assert broken.state == "available" and broken.refcount == 0 and broken.runtime is None
        assert "b" not in daemon.agents and daemon.counters["denials"] == 0
        assert (await error_of(daemon.complete("broken", 2, "Hi"))).code == "MODEL_LOAD_FAILED"
        assert broken.inflight == 0 and daemon.ledger.allocated == before.allocated
        engine.fail_load("m", RuntimeError("boom"))  # any error, not only ApplianceError, rolls back
        await daemon.unregister("a")
        with pytest.raises(RuntimeError):
            await daemon.register("a", "m")
        assert daemon.ledger.allocated == 0 and daemon.model_state("m") == "available"
        engine.heal()
        await daemon.register("b", "broken")  # the id was not left claimed, and the model loads now
        assert broken.state == "loaded" and daemon.ledger.allocated == 1 * GiB

    run(tmp_path, body, models={"m": {}, "broken": {}})


def test_concurrent_registrations_load_the_model_once(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        engine.load_gate.close()
        jobs = [asyncio.create_task(daemon.register(f"agent{i}", "m")) for i in range(20)]
        await engine.load_gate.arrival(1)
        assert daemon.model_state("m") == "loading" and daemon.models["m"].refcount == 20
        assert daemon.ledger.allocated == 1 * GiB  # reserved before the load
        engine.load_gate.open()
        agents = await asyncio.gather(*jobs)
        assert len(engine.loads) == 1 and len({a.model for a in agents}) == 1
        assert daemon.models["m"].refcount == 20 and daemon.ledger.allocated == 1 * GiB

    run(tmp_path, body)


def test_a_caller_that_goes_away_mid_load_leaves_the_model_loaded_for_the_sweep(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        engine.load_gate.close()
        job = asyncio.create_task(daemon.register("a", "m"))
        await engine.load_gate.arrival(1)
        job.cancel()
        engine.load_gate.open()
        with pytest.raises(asyncio.CancelledError):
            await job
        model = daemon.models["m"]
        assert model.state == "loaded" and model.refcount == 0 and "a" not in daemon.agents
        env.clock.advance(60)
        assert await daemon.sweep_idle() == ["m"] and daemon.ledger.allocated == 0

    run(tmp_path, body, models={"m": {"idle_ttl_s": 60}})


# -- model state -----------------------------------------------------------------------------------------------

def test_model_state_goes_available_loading_loaded_unloading_available(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine

        def shown() -> tuple[str, str]:
            snap = {m["name"]: m for m in daemon.snapshot()["models"]}
            return daemon.model_state("m"), snap["m"]["state"] if "m" in snap else "available"

        assert shown() == ("available", "available")
        engine.load_gate.close()
        registering = asyncio.create_task(daemon.register("a", "m"))
        await engine.load_gate.arrival(1)
        assert shown() == ("loading", "loading")
        engine.load_gate.open()
        await registering
        assert shown() == ("loaded", "loaded")
        engine.close_gate.close()
        leaving = asyncio.create_task(daemon.unregister("a"))
        await engine.close_gate.arrival(1)
        assert shown() == ("unloading", "unloading")
        assert daemon.ledger.allocated == 1 * GiB  # its bytes are released once it is closed
        engine.close_gate.open()
        await leaving
        assert shown() == ("available", "available") and daemon.ledger.allocated == 0
        assert daemon.model_state("never-heard-of") == "available"

    run(tmp_path, body)


# -- decoding: cancellation, KV swap, stateless requests -------------------------------------------------------

def test_cancel_stops_at_the_next_token(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon, gate = env.daemon, env.engine.gate
        agent = await daemon.register("a", "m")
        streamed: list[Token] = []
        cancel = threading.Event()
        gate.close()
        gate.release(3)
        job = asyncio.create_task(daemon.decode("a", 100, "Hello", on_token=streamed.append, cancel=cancel))
        await gate.arrival(4)  # three tokens out, the fourth held at the gate
        assert [t.index for t in streamed] == [0, 1, 2]
        cancel.set()
        result = await job
        assert result.generation.stop_reason == "cancelled" and result.generation.generated_tokens == 3
        assert "".join(t.text for t in streamed) == result.generation.text == fresh_text("Hello", 3)
        assert agent.model.inflight == 0 and not agent.lock.locked() and gate.passed == 3
        assert agent.conversation.tokens == []  # rolled back: the request is as if never sent

        # The caller's task cancelled instead: the generation stops at its next token, nothing left running.
        job = asyncio.create_task(daemon.decode("a", 100, "Hello"))
        await gate.arrival(5)
        job.cancel()
        with pytest.raises(asyncio.CancelledError):
            await job
        assert agent.model.inflight == 0 and not agent.lock.locked() and gate.held == 0
        assert agent.conversation.tokens == []
        gate.open()
        more = await daemon.decode("a", 2, "Hello")  # the conversation goes on as if neither had been sent
        assert more.generation.text == fresh_text("Hello", 2)
        assert len(agent.conversation.tokens) == 1 + len("Hello") + 2

    run(tmp_path, body)


def test_kv_swap_is_reported_and_continues_exactly(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon = env.daemon
        for agent, model in (("a", "m"), ("b", "m"), ("x", "other")):
            await daemon.register(agent, model)
        first = await daemon.decode("a", 8, "Hello")
        assert (first.agent, first.evicted, first.restored) == ("a", None, False)
        b = await daemon.decode("b", 8, "Something else")
        assert (b.evicted, b.restored) == ("a", False)
        x = await daemon.decode("x", 4, "Other model")  # agents on different models never evict each other
        assert (x.evicted, x.restored) == (None, False)
        states = {s["id"]: s for s in daemon.snapshot()["agents"]}
        assert states["a"]["state"] == "host" and states["a"]["state_bytes"] == 4 * (1 + 5 + 7)
        assert states["b"]["state"] == "device" and states["x"]["state"] == "device"
        second = await daemon.decode("a", 8, "")
        assert (second.evicted, second.restored) == ("b", True)
        assert first.generation.text + second.generation.text == fresh_text("Hello", 16)
        again = await daemon.decode("a", 1, "")  # still live: no swap
        assert (again.evicted, again.restored) == (None, False)
        assert daemon.counters["kv_swaps"] == 2 and daemon.counters["kv_restores"] == 1
        assert daemon.counters["decodes"] == 5 and daemon.counters["tokens"] == 8 + 8 + 4 + 8 + 1
        runtime = daemon.models["m"].runtime
        assert runtime is not None and (runtime.saves, runtime.restores) == (2, 1)

    run(tmp_path, body, models={"m": {}, "other": {}}, engine={"live_slots": 1})


def test_stateless_requests_leave_no_conversation_behind(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon = env.daemon
        one = await daemon.complete("m", 6, "Hello")
        two = await daemon.complete("m", 6, "Hello")
        assert one.agent is None and one.generation.text == two.generation.text == fresh_text("Hello", 6)
        assert (two.evicted, two.restored) == (None, False)  # the first one's context was dropped already
        model = daemon.models["m"]
        assert model.runtime is not None and model.runtime.live == []
        assert model.refcount == 0 and model.inflight == 0 and not daemon.agents
        await daemon.register("a", "m")
        await daemon.decode("a", 4, "Hi")
        anon = await daemon.complete("m", 2, "Yo")  # it evicts the live agent, which then comes back
        assert anon.evicted == "a"
        back = await daemon.decode("a", 4, "")
        assert back.restored and back.evicted is None
        full = fresh_text("Hello", 50)
        stop = await daemon.complete("m", 50, "Hello", Sampling(stop=(full[1:3],)))
        assert stop.generation.stop_reason == "stop" and stop.generation.text == full[:full.find(full[1:3])]
        env.engine.eos_when = lambda tokens: len(tokens) >= 1 + len("Hello") + 2
        eos = await daemon.complete("m", 50, "Hello")
        assert eos.generation.stop_reason == "eos" and eos.generation.generated_tokens == 3
        assert (await error_of(daemon.complete("ghost", 2, "Hi"))).code == "UNKNOWN_MODEL"
        assert (await error_of(daemon.complete("m", 2, ""))).code == "BAD_REQUEST"

    run(tmp_path, body, engine={"live_slots": 1})


def test_context_overflow_is_refused_before_any_token(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon = env.daemon
        error = await error_of(daemon.complete("m", 60, "H" * 63))
        assert error.code == "CONTEXT_OVERFLOW"
        assert error.details == {"n_ctx": 64, "context_tokens": 0, "prompt_tokens": 64, "requested_tokens": 60}
        agent = await daemon.register("a", "m")
        await daemon.decode("a", 40, "Hello")
        assert len(agent.conversation.tokens) == 46 and env.engine.tokens_generated == 40
        assert (await daemon.decode("a", 18, "")).generation.generated_tokens == 18  # exactly full is fine
        error = await error_of(daemon.decode("a", 1, ""))
        assert error.code == "CONTEXT_OVERFLOW" and error.details["context_tokens"] == 64
        assert len(agent.conversation.tokens) == 64 and env.engine.tokens_generated == 58

    run(tmp_path, body, models={"m": {"n_ctx": 64}})


# -- shutting down ---------------------------------------------------------------------------------------------

def test_close_ends_everything(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        await daemon.register("a", "m")
        await daemon.register("b", "other")
        engine.gate.close()  # never released: only close() can end these
        decoding = asyncio.create_task(daemon.decode("a", 100, "Hello"))
        completing = asyncio.create_task(daemon.complete("other", 100, "Hi"))
        await engine.gate.arrival(1)
        await daemon.close()
        assert (await decoding).generation.stop_reason == "cancelled"
        assert (await completing).generation.stop_reason == "cancelled"
        assert engine.closed and engine.live_runtimes == [] and len(engine.runtimes) == 2
        assert daemon.ledger.allocated == 0 and not daemon.agents
        assert all(m.state == "available" and m.inflight == 0 for m in daemon.models.values())
        assert (await error_of(daemon.register("c", "m"))).code == "SHUTTING_DOWN"
        assert (await error_of(daemon.complete("m", 2, "Hi"))).code == "SHUTTING_DOWN"

    run(tmp_path, body, models={"m": {}, "other": {}})


# -- reading config at use time --------------------------------------------------------------------------------

def test_a_changed_model_spec_applies_from_the_next_load(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        await daemon.register("a", "m")
        old = daemon.models["m"]
        daemon.config = make_config(tmp_path, {"m": {"n_ctx": 128}})  # the daemon reads its config at use time
        assert daemon.resolve("m") is old  # loaded: it keeps its spec
        engine.close_gate.close()
        leaving = asyncio.create_task(daemon.unregister("a"))
        await engine.close_gate.arrival(1)
        assert daemon.resolve("m") is old  # unloading: still the same model, which holds the ledger key
        engine.close_gate.open()
        await leaving
        new = daemon.resolve("m")
        assert new is not old and new.spec.n_ctx == 128
        await daemon.register("a", "m")
        assert new.runtime is not None and new.runtime.n_ctx == 128 and daemon.ledger.allocated == 1 * GiB

    run(tmp_path, body)


def test_the_sweep_period_follows_the_current_config(tmp_path: Path) -> None:
    assert sweep_period(make_config(tmp_path, {"m": {"idle_ttl_s": 8}})) == 2
    assert sweep_period(make_config(tmp_path, {"m": {"idle_ttl_s": 0}})) == 5  # no TTL: the longest period
    assert sweep_period(make_config(tmp_path, {"m": {"idle_ttl_s": 0.1}})) == 0.05  # never busier than that
    assert sweep_period(make_config(tmp_path, {})) == 5


# -- agent idle TTL (L11) -------------------------------------------------------------------------------------

def test_idle_agents_expire_and_their_model_goes_with_the_last(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon, clock, gate = env.daemon, env.clock, env.engine.gate
        owner = object()
        await daemon.register("idle", "m")
        await daemon.register("owned", "m", owner=owner)  # a MAGN connection's agent expires too
        await daemon.register("talker", "m")
        clock.advance(50)
        await daemon.decode("talker", 2, "Hi")  # a decode restarts its timer
        clock.advance(10)
        assert await daemon.sweep_idle() == []  # models: none; agents: the two idle ones went
        assert sorted(daemon.agents) == ["talker"] and daemon.counters["agents_expired"] == 2
        assert (await error_of(daemon.decode("owned", 1, "x"))).code == "UNKNOWN_AGENT"
        await daemon.release_owner(owner)  # the connection closing later finds nothing left to do
        gate.close()
        running = asyncio.create_task(daemon.decode("talker", 2, "Hi"))
        await gate.arrival(1)
        clock.advance(1e6)
        assert await daemon.expire_agents() == []  # never while a command runs on it
        gate.open()
        await running
        clock.advance(59.9)
        assert await daemon.expire_agents() == []  # finishing counts as a use
        clock.advance(0.1)
        assert await daemon.expire_agents() == ["talker"]
        model = daemon.models["m"]  # the last agent gone: its model is unloaded (L4)
        assert not daemon.agents and model.refcount == 0 and model.state == "available"
        assert daemon.ledger.allocated == 0

    run(tmp_path, body, agent_idle_ttl_s=60)


def test_agents_expire_after_a_day_by_default_and_never_with_0(tmp_path: Path) -> None:
    async def by_default(env: Env) -> None:
        await env.daemon.register("a", "m")
        env.clock.advance(86399)
        assert await env.daemon.sweep_idle() == [] and list(env.daemon.agents) == ["a"]
        env.clock.advance(1)
        await env.daemon.sweep_idle()
        assert not env.daemon.agents and env.daemon.counters["agents_expired"] == 1

    async def never(env: Env) -> None:
        await env.daemon.register("a", "m")
        env.clock.advance(1e9)
        assert await env.daemon.sweep_idle() == [] and list(env.daemon.agents) == ["a"]

    assert make_config(tmp_path, {}).agent_idle_ttl_s == 86400
    run(tmp_path, by_default)
    run(tmp_path, never, agent_idle_ttl_s=0)


def test_an_agent_used_while_the_sweep_works_on_another_stays(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon, clock, engine = env.daemon, env.clock, env.engine
        await daemon.register("x", "other")
        await daemon.register("a", "m")
        clock.advance(61)  # both idle past the TTL when the sweep reads them
        engine.close_gate.close()  # x is the last on its model: hold the sweep in that model's unload
        sweep = asyncio.create_task(daemon.expire_agents())
        await engine.close_gate.arrival(1)
        clock.advance(1)
        running = asyncio.create_task(daemon.decode("a", 1, "Hi"))  # a is used meanwhile
        await asyncio.sleep(0)
        engine.close_gate.open()
        await running
        assert await sweep == ["x"] and list(daemon.agents) == ["a"]  # a re-checked under its lock: stays

    run(tmp_path, body, models={"m": {}, "other": {}}, agent_idle_ttl_s=60)


# -- log lines ------------------------------------------------------------------------------------------------

def test_loads_unloads_agents_expiry_and_denials_are_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    models = {"m": {"idle_ttl_s": 30}, "big": {"vram_bytes": "100GiB"}, "broken": {}}

    async def body(env: Env) -> None:
        daemon, clock = env.daemon, env.clock
        await daemon.register("a", "m", owner=object())
        await daemon.unregister("a")
        await daemon.register("b", "m")
        clock.advance(100)
        await daemon.sweep_idle()
        await daemon.complete("m", 1, "Hi")
        clock.advance(30)
        await daemon.sweep_idle()
        await error_of(daemon.register("c", "big"))
        env.engine.fail_load("broken")
        await error_of(daemon.complete("broken", 1, "Hi"))
        await daemon.register("d", "m")

    caplog.set_level("INFO", logger="appliance.daemon.core")
    run(tmp_path, body, models=models, agent_idle_ttl_s=60)
    records = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "appliance.daemon.core"]
    text = [message for _, message in records]

    def find(*parts: str) -> list[tuple[str, str]]:
        return [(level, msg) for level, msg in records if all(part in msg for part in parts)]

    assert len(find("model m loaded: estimate 1073741824 bytes", " s")) == 4
    assert find("agent a registered on model m", "owned by its connection")
    assert find("agent a unregistered (UNREGISTER)") and find("agent b registered on model m")
    assert find("agent b unregistered (expired: idle for 100.0 s, agent_idle_ttl_s 60 s)")
    assert len(find("model m unloaded (last agent left)")) == 2
    expiry = text.index("model m expired: idle for 30.0 s, TTL 30 s")
    assert text[expiry + 1] == "model m unloaded (idle TTL)"
    denial = find("model big denied by the VRAM ledger", "needs 107374182400 bytes", "of ")
    assert [level for level, _ in denial] == ["WARNING"]
    assert [level for level, _ in find("model broken not loaded: MODEL_LOAD_FAILED")] == ["WARNING"]
    assert find("model m unloaded (shutdown)") and find("1 agents dropped at shutdown")
    assert all("Traceback" not in message for message in text)


def test_the_sweep_period_follows_the_agent_idle_ttl_too(tmp_path: Path) -> None:
    config = make_config(tmp_path, {"m": {"idle_ttl_s": 0}})
    assert sweep_period(config.with_overrides(agent_idle_ttl_s=2.0)) == 0.5


# -- engine v2: sequences, admission ---------------------------------------------------------------------------

async def settled(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.005)


def test_requests_beyond_the_slots_wait_in_turn_and_one_given_up_leaves_nothing(tmp_path: Path) -> None:
    """One sequence (``live_slots: 1``): a second agent's decode waits for it; cancelled while it waits, it never
    runs and its conversation is untouched; a third still gets the sequence when the first ends."""
    async def body(env: Env) -> None:
        daemon, gate = env.daemon, env.engine.gate
        for agent in ("a", "b", "c"):
            await daemon.register(agent, "m")
        gate.close()
        first = asyncio.ensure_future(daemon.decode("a", 4, "Hello"))
        await gate.arrival(1)  # a holds the only sequence; its first step (and so the engine thread) at the gate
        waiting = asyncio.ensure_future(daemon.decode("b", 4, "Other"))
        third = asyncio.ensure_future(daemon.decode("c", 2, "Third"))
        await asyncio.sleep(0.05)  # their starts are queued; the engine serves its queues in turn between steps
        gate.release(3)  # three of a's four steps: b's and c's starts run meanwhile, find it busy and queue up
        await gate.arrival(4)
        model = daemon.models["m"]
        await settled(lambda: model.admission.waiting == 2)
        waiting.cancel()
        await settled(lambda: model.admission.waiting == 1)
        gate.open()
        assert (await first).generation.text == fresh_text("Hello", 4)
        assert (await third).generation.text == fresh_text("Third", 2)
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert daemon.agents["b"].conversation.tokens == [] and daemon.agents["b"].conversation.where == "empty"
        assert model.inflight == 0 and model.active == 0 and not model.runtime.busy and daemon.generating == 0

    run(tmp_path, body, engine={"live_slots": 1})


# -- counting a prompt's tokens -------------------------------------------------------------------------------------

def test_count_loads_the_model_and_counts_what_a_generation_of_the_prompt_counts(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        model = daemon.resolve("m")
        assert model.state == "available"
        env.clock.advance(5)
        counted = await daemon.count("m", "Hello there")
        assert model.state == "loaded" and len(engine.loads) == 1
        assert model.inflight == 0 and model.last_used == env.clock()
        result = await daemon.complete("m", 2, "Hello there")
        assert counted == result.generation.prompt_tokens == len("Hello there") + 1  # the BOS token counted
        assert (await error_of(daemon.count("ghost", "Hi"))).code == "UNKNOWN_MODEL"
        daemon.closing = True
        assert (await error_of(daemon.count("m", "Hi"))).code == "SHUTTING_DOWN"

    run(tmp_path, body)
