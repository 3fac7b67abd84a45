"""The daemon side of hot reload (SPEC C3): :meth:`Daemon.apply_config` (admission, live keys, retiring) and
:meth:`Daemon.reload_model` (one model's runtime replaced, its agents kept), on the fake engine with a hand-driven
clock, then on the real tiny models where the behaviour is llama.cpp's (re-evaluating tokens on new weights)."""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from appliance.config.validate import Config, parse_config
from appliance.daemon import policy
from appliance.daemon.core import Daemon, reload_key, vocabulary_notice
from appliance.daemon.devices import FakeDevice
from appliance.engine.fake import FakeEngine, ManualClock, fresh_text
from appliance.errors import ApplianceError
from appliance.protocol import lines as line_protocol
from appliance.server import lines as line_server
from appliance.server.magn import completion

GiB = 1024**3


def model_spec(tmp_path: Path, name: str, **spec: Any) -> dict[str, Any]:
    return {"name": name, "path": str(tmp_path / f"{name}.gguf"), "vram_bytes": "1GiB", **spec}


def make_config(tmp_path: Path, models: list[dict[str, Any]], **extra: Any) -> Config:
    doc: dict[str, Any] = {"data_dir": str(tmp_path / "state"), "device": "fake:8GiB",
                           "model_dirs": [str(tmp_path)], "resync_interval_s": 0, "models": models, **extra}
    return parse_config(yaml.safe_dump(doc), base_dir=tmp_path, check_files=False)


@dataclass
class Env:
    daemon: Daemon
    engine: FakeEngine
    tmp_path: Path

    def config(self, models: list[dict[str, Any]], **extra: Any) -> Config:
        return make_config(self.tmp_path, models, **extra)


def run(tmp_path: Path, models: list[dict[str, Any]], body: Callable[[Env], Awaitable[None]], **extra: Any) -> Env:
    """Build a daemon on a FakeEngine and an 8 GiB fake device (cap 90 %), run ``body``, close the daemon."""
    engine = FakeEngine()
    daemon = Daemon(make_config(tmp_path, models, **extra), FakeDevice("8GiB", process_used=0), engine,
                    clock=ManualClock())
    env = Env(daemon, engine, tmp_path)

    async def main() -> None:
        try:
            await body(env)
        finally:
            engine.gate.open()
            engine.load_gate.open()
            engine.close_gate.open()
            await daemon.close()

    asyncio.run(asyncio.wait_for(main(), 30))
    return env


async def error_of(awaitable: Awaitable[Any]) -> ApplianceError:
    with pytest.raises(ApplianceError) as info:
        await awaitable
    return info.value


async def until(condition: Callable[[], bool]) -> None:
    """Let the loop run until ``condition`` holds (bounded)."""
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the condition never held")


def status_records(daemon: Daemon, kind: str) -> list[dict[str, str]]:
    body = line_server.status_body(daemon.snapshot())
    return [line_protocol.parse_fields(line[len(kind) + 1:]) for line in body if line.startswith(f"{kind} ")]


# -- admission -------------------------------------------------------------------------------------------------

def test_a_lower_admission_evicts_nobody_and_refuses_new_loads_until_raised(tmp_path: Path) -> None:
    models = [model_spec(tmp_path, name) for name in ("m1", "m2", "m3")]

    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        await daemon.register("a", "m1")
        await daemon.register("b", "m2")
        assert status_records(daemon, "ledger")[0]["over_cap"] == "no"
        done = daemon.apply_config(env.config(models, admission_percent=20))  # cap 1.6 GiB < 2 GiB allocated
        assert any("ledger cap" in line for line in done)
        assert daemon.ledger.cap == 8 * GiB * 20 // 100 and daemon.ledger.allocated == 2 * GiB
        assert len(engine.live_runtimes) == 2 and daemon.model_state("m1") == daemon.model_state("m2") == "loaded"
        assert daemon.snapshot()["ledger"]["over_cap"] is True
        assert status_records(daemon, "ledger")[0]["over_cap"] == "yes"
        assert (await daemon.decode("a", 3, "Hi")).generation.text == fresh_text("Hi", 3)  # still serving
        denied = await error_of(daemon.register("c", "m3"))
        assert denied.code == "VRAM_LEDGER_DENY" and denied.details["ledger_max_bytes"] == daemon.ledger.cap
        assert daemon.model_state("m3") == "available" and len(engine.loads) == 2
        daemon.apply_config(env.config(models, admission_percent=90))
        assert daemon.snapshot()["ledger"]["over_cap"] is False
        await daemon.register("c", "m3")
        assert daemon.ledger.allocated == 3 * GiB

    run(tmp_path, models, body)


def test_a_live_model_key_applies_in_place(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon = env.daemon
        agent = await daemon.register("a", "m")
        runtime = agent.model.runtime
        daemon.apply_config(env.config([model_spec(tmp_path, "m", idle_ttl_s=7)]))
        assert daemon.models["m"] is agent.model and agent.model.runtime is runtime
        assert agent.model.spec.idle_ttl_s == 7 and daemon.models_to_reload() == []

    run(tmp_path, [model_spec(tmp_path, "m")], body)


# -- retiring removed models ----------------------------------------------------------------------------------

@pytest.mark.parametrize(("retired", "refcount", "inflight", "want"), [
    (True, 0, 0, True), (True, 1, 0, False), (True, 0, 1, False), (False, 0, 0, False)])
def test_unload_retired(retired: bool, refcount: int, inflight: int, want: bool) -> None:
    view = policy.ModelView("m", True, refcount, inflight, 0.0, 60.0, retired)
    assert policy.unload_retired(view) is want


def test_a_removed_model_without_users_unloads_at_once(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        await daemon.complete("m", 2, "Hi")  # loaded, nobody on it
        done = daemon.apply_config(env.config([model_spec(tmp_path, "other")]))
        assert any("m retired" in line for line in done)
        await daemon.settle()
        assert "m" not in daemon.models and daemon.ledger.allocated == 0 and engine.live_runtimes == []
        assert [m["name"] for m in daemon.snapshot()["models"]] == []
        assert (await error_of(daemon.register("a", "m"))).code == "UNKNOWN_MODEL"
        assert (await error_of(daemon.complete("m", 2, "Hi"))).code == "UNKNOWN_MODEL"

    run(tmp_path, [model_spec(tmp_path, "m")], body)


def test_a_removed_model_keeps_its_agents_and_unloads_when_the_last_leaves(tmp_path: Path, tiny_model: Path) -> None:
    path = tmp_path / "m.gguf"
    shutil.copy(tiny_model, path)  # a real GGUF: a REGISTER by path reads it

    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        a = await daemon.register("a", "m")
        await daemon.register("b", "m")
        model = a.model
        daemon.apply_config(env.config([]))
        await daemon.settle()
        assert model.retired and model.state == "loaded" and daemon.models["m"] is model
        assert [m["retired"] for m in daemon.snapshot()["models"]] == [True]
        assert status_records(daemon, "model")[0]["retired"] == "yes"
        assert (await error_of(daemon.register("c", "m"))).code == "UNKNOWN_MODEL"
        assert (await error_of(daemon.complete("m", 2, "Hi"))).code == "UNKNOWN_MODEL"
        by_path = await daemon.register("p", str(path))  # its file by path: a model of its own, not the retired one
        assert by_path.model is not model and by_path.model.key == str(path.resolve()) and model.refcount == 2
        await daemon.unregister("p")
        assert (await daemon.decode("a", 3, "Hi")).generation.text == fresh_text("Hi", 3)  # its agents work on
        await daemon.unregister("a")
        assert daemon.models["m"] is model and model.state == "loaded"
        await daemon.unregister("b")  # the last one: unloaded and forgotten
        assert "m" not in daemon.models and daemon.ledger.allocated == 0 and engine.live_runtimes == []

    run(tmp_path, [model_spec(tmp_path, "m")], body)


def test_a_removed_model_unloads_when_its_last_request_ends(tmp_path: Path) -> None:
    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        engine.gate.close()
        request = asyncio.ensure_future(daemon.complete("m", 2, "Hi"))
        await engine.gate.arrival(1)
        daemon.apply_config(env.config([]))
        await daemon.settle()
        assert daemon.models["m"].retired and daemon.model_state("m") == "loaded"  # a request is in flight
        engine.gate.open()
        assert (await request).generation.text == fresh_text("Hi", 2)
        await daemon.settle()
        assert "m" not in daemon.models and engine.live_runtimes == []

    run(tmp_path, [model_spec(tmp_path, "m")], body)


def test_a_model_that_comes_back_is_un_retired(tmp_path: Path) -> None:
    spec = model_spec(tmp_path, "m")

    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        a = await daemon.register("a", "m")
        daemon.apply_config(env.config([]))
        assert a.model.retired
        done = daemon.apply_config(env.config([spec]))  # unchanged: it simply serves again
        assert not a.model.retired and any("back" in line for line in done)
        await daemon.register("b", "m")
        assert a.model.refcount == 2 and len(engine.loads) == 1
        await daemon.unregister("a")
        await daemon.unregister("b")
        await daemon.register("a", "m")
        daemon.apply_config(env.config([]))
        daemon.apply_config(env.config([{**spec, "n_ctx": 512}]))  # changed meanwhile: reloaded like any change
        assert not a.model.retired and daemon.models_to_reload() == ["m"]
        await daemon.reload_model("m")
        assert a.model.runtime is not None and a.model.runtime.n_ctx == 512 and len(engine.live_runtimes) == 1

    run(tmp_path, [spec], body)


# -- reloading one model --------------------------------------------------------------------------------------

def test_a_reload_with_the_same_vocabulary_keeps_tokens_and_leaves_other_models_alone(tmp_path: Path) -> None:
    m, o = model_spec(tmp_path, "m"), model_spec(tmp_path, "o")

    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        a = await daemon.register("a", "m")
        await daemon.register("b", "m")
        c = await daemon.register("c", "o")
        await daemon.register("d", "o")
        await daemon.decode("a", 4, "Hello")
        await daemon.decode("b", 3, "World")  # a parked in host RAM, b live
        await daemon.decode("c", 3, "Other")
        await daemon.decode("d", 3, "Else")  # c parked
        other_runtime = c.model.runtime
        c_state = (list(c.conversation.tokens), bytes(c.conversation.buffer or b""), c.conversation.where)
        tokens = {agent: list(daemon.agents[agent].conversation.tokens) for agent in ("a", "b")}
        old = a.model.runtime
        daemon.apply_config(env.config([{**m, "n_ctx": 4096, "vram_bytes": "2GiB"}, o]))
        assert daemon.models_to_reload() == ["m"] and a.model.runtime is old  # apply_config loads nothing

        line = await daemon.reload_model("m")

        assert line == "m reloaded (2 agents re-evaluate their tokens)"
        model = a.model
        assert daemon.models["m"] is model and model.runtime is not old and old.closed  # same Model, new runtime
        assert model.runtime.n_ctx == 4096 and model.spec.n_ctx == 4096 and model.estimate == 2 * GiB
        assert daemon.ledger.reservations() == {"o": GiB, "m": 2 * GiB} and daemon.models_to_reload() == []
        for agent in ("a", "b"):
            conv = daemon.agents[agent].conversation
            assert conv.tokens == tokens[agent]
            assert (conv.where, conv.buffer, conv.n_evaluated) == ("empty", None, 0)
        assert c.model.runtime is other_runtime and not other_runtime.closed
        assert (list(c.conversation.tokens), bytes(c.conversation.buffer or b""), c.conversation.where) == c_state
        result = await daemon.decode("a", 3, "")  # re-evaluates its tokens, continues as if nothing happened
        assert result.rebuilt and result.notice is None
        assert result.generation.text == fresh_text("Hello", 7)[4:]
        assert (await daemon.decode("c", 2, "")).generation.text == fresh_text("Other", 5)[3:]
        assert daemon.counters["reloads"] == 1 and len(engine.live_runtimes) == 2

    run(tmp_path, [m, o], body)


def test_a_reload_with_another_vocabulary_resets_conversations_with_a_notice_once(tmp_path: Path) -> None:
    m = model_spec(tmp_path, "m")

    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        a = await daemon.register("a", "m")
        await daemon.decode("a", 4, "Hello")
        engine.set_vocabulary("m2", "another vocabulary")
        daemon.apply_config(env.config([{**m, "path": str(tmp_path / "m2.gguf")}]))

        line = await daemon.reload_model("m")

        assert line == "m reloaded with a different vocabulary (1 agents' conversations reset)"
        assert a.conversation.tokens == [] and a.notice == vocabulary_notice("m")
        empty = await error_of(daemon.decode("a", 3, ""))  # nothing to continue: the notice waits
        assert empty.code == "BAD_REQUEST" and a.notice is not None
        first = await daemon.decode("a", 3, "Hi")
        assert first.notice == vocabulary_notice("m") and first.generation.text == fresh_text("Hi", 3)
        assert completion("t1", first).stats["notice"] == vocabulary_notice("m")  # MAGN's TASK_COMPLETE
        second = await daemon.decode("a", 2, "")
        assert second.notice is None and a.notice is None and "notice" not in completion("t2", second).stats

    run(tmp_path, [m], body)


def test_the_line_protocol_shows_the_notice_on_the_decode_reply_once(tmp_path: Path) -> None:
    m = model_spec(tmp_path, "m")

    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        await daemon.register("a", "m")
        engine.set_vocabulary("m2", "another vocabulary")
        daemon.apply_config(env.config([{**m, "path": str(tmp_path / "m2.gguf")}]))
        await daemon.reload_model("m")
        command = line_protocol.parse_line("DECODE a 3 Hi")
        first = line_protocol.parse_reply(await line_server.execute(daemon, command, threading.Event()))
        second = line_protocol.parse_reply(await line_server.execute(daemon, command, threading.Event()))
        assert first.fields["notice"] == vocabulary_notice("m") and first.body == fresh_text("Hi", 3)
        assert "notice" not in second.fields and second.error is None

    run(tmp_path, [m], body)


def test_a_new_estimate_that_does_not_fit_keeps_the_old_model_serving(tmp_path: Path) -> None:
    m = model_spec(tmp_path, "m")

    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        a = await daemon.register("a", "m")
        await daemon.decode("a", 2, "Hi")
        old, before = a.model.runtime, daemon.ledger.reservations()
        daemon.apply_config(env.config([{**m, "vram_bytes": "7GiB"}]))  # 1 + 7 GiB > the 7.2 GiB cap

        denied = await error_of(daemon.reload_model("m"))

        assert denied.code == "VRAM_LEDGER_DENY" and denied.details["requested_table_bytes"] == 7 * GiB
        assert daemon.ledger.reservations() == before and reload_key("m") not in daemon.ledger.reservations()
        assert a.model.runtime is old and not old.closed and a.model.spec.vram_bytes == GiB
        assert len(engine.loads) == 1 and daemon.models_to_reload() == ["m"]
        assert (await daemon.decode("a", 2, "")).generation.text == fresh_text("Hi", 4)[2:]

    run(tmp_path, [m], body)


def test_a_failed_load_keeps_the_old_model_serving(tmp_path: Path) -> None:
    m = model_spec(tmp_path, "m")

    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        a = await daemon.register("a", "m")
        await daemon.decode("a", 2, "Hi")
        old, before = a.model.runtime, daemon.ledger.reservations()
        engine.fail_load("broken")
        daemon.apply_config(env.config([{**m, "path": str(tmp_path / "broken.gguf")}]))

        failed = await error_of(daemon.reload_model("m"))

        assert failed.code == "MODEL_LOAD_FAILED" and engine.loads[-1].name == "broken.gguf"
        assert daemon.ledger.reservations() == before and daemon.ledger.allocated == GiB
        assert a.model.runtime is old and not old.closed and engine.live_runtimes == [old]
        assert a.model.state == "loaded" and a.conversation.where == "device"
        assert (await daemon.decode("a", 2, "")).generation.text == fresh_text("Hi", 4)[2:]

    run(tmp_path, [m], body)


def test_reloading_a_model_that_is_not_loaded_changes_its_next_load(tmp_path: Path) -> None:
    m = model_spec(tmp_path, "m")

    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        assert "not loaded" in await daemon.reload_model("m")  # never used
        await daemon.complete("m", 1, "Hi")
        await daemon.unload(daemon.models["m"])
        daemon.apply_config(env.config([{**m, "path": str(tmp_path / "m2.gguf")}]))
        assert daemon.models_to_reload() == []
        assert "not loaded" in await daemon.reload_model("m")
        await daemon.register("a", "m")
        assert engine.loads[-1].name == "m2.gguf" and len(engine.live_runtimes) == 1
        assert (await error_of(daemon.reload_model("ghost"))).code == "UNKNOWN_MODEL"

    run(tmp_path, [m], body)


def test_jobs_queued_during_the_swap_run_on_the_new_runtime(tmp_path: Path) -> None:
    m = model_spec(tmp_path, "m")

    async def body(env: Env) -> None:
        daemon, engine = env.daemon, env.engine
        a = await daemon.register("a", "m")
        await daemon.register("b", "m")
        await daemon.decode("a", 2, "Hi")
        old = a.model.runtime
        daemon.apply_config(env.config([{**m, "n_ctx": 512}]))
        engine.close_gate.close()
        reload = asyncio.ensure_future(daemon.reload_model("m"))
        await engine.close_gate.arrival(1)  # the swap job holds the engine thread, closing the old runtime
        decode = asyncio.ensure_future(daemon.decode("a", 2, ""))
        leave = asyncio.ensure_future(daemon.unregister("b"))
        await until(lambda: a.model.inflight > 0)  # both queued behind the swap
        await asyncio.sleep(0.01)
        engine.close_gate.open()
        await reload
        assert (await decode).generation.text == fresh_text("Hi", 4)[2:]
        await leave
        assert a.model.runtime is not old and old.closed and a.model.runtime.live == [a.conversation]

    run(tmp_path, [m], body)


# -- the real tiny models -------------------------------------------------------------------------------------

def real_daemon(tmp_path: Path, path: Path) -> Daemon:
    from appliance.engine.runtime import Engine

    config = make_config(tmp_path, [{"name": "tiny", "path": str(path), "n_ctx": 256}])
    return Daemon(config, FakeDevice("8GiB", process_used=0), Engine(1))


def test_a_reload_of_the_same_file_continues_exactly_like_no_reload(tmp_path: Path, tiny_model: Path) -> None:
    path = tmp_path / "tiny.gguf"
    shutil.copy(tiny_model, path)
    daemon = real_daemon(tmp_path, path)
    prompt = "Once upon a time, in a land far away"

    async def main() -> None:
        try:
            await daemon.register("ref", "tiny")
            ref_1 = await daemon.decode("ref", 12, prompt)
            ref_2 = await daemon.decode("ref", 12, "")
            await daemon.unregister("ref")
            agent = await daemon.register("a", "tiny")
            a_1 = await daemon.decode("a", 12, prompt)
            old = agent.model.runtime
            assert await daemon.reload_model("tiny") == "tiny reloaded (1 agents re-evaluate their tokens)"
            assert agent.model.runtime is not old
            a_2 = await daemon.decode("a", 12, "")
            assert a_2.rebuilt
            assert (a_1.generation.tokens, a_2.generation.tokens) == (ref_1.generation.tokens,
                                                                      ref_2.generation.tokens)
            assert a_2.generation.text == ref_2.generation.text
        finally:
            await daemon.close()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_other_weights_in_the_same_file_keep_the_conversation(tmp_path: Path, tiny_model: Path) -> None:
    from appliance.engine.tinymodel import write_tiny_model

    path = tmp_path / "tiny.gguf"
    shutil.copy(tiny_model, path)
    daemon = real_daemon(tmp_path, path)

    async def main() -> None:
        try:
            agent = await daemon.register("a", "tiny")
            first = await daemon.decode("a", 8, "Once upon a time")
            count = len(agent.conversation.tokens)
            assert count == first.generation.prompt_tokens + first.generation.generated_tokens
            old_vocabulary = await daemon.engine.call(agent.model.runtime.vocabulary)
            await asyncio.to_thread(write_tiny_model, path, layers=4, dim=256, seed=7)  # new weights, same vocab
            assert "1 agents re-evaluate" in await daemon.reload_model("tiny")
            assert await daemon.engine.call(agent.model.runtime.vocabulary) == old_vocabulary
            after = await daemon.decode("a", 8, "")
            assert after.generation.prompt_tokens == 0 and after.generation.generated_tokens == 8
            assert len(agent.conversation.tokens) == count + 8 and after.notice is None
        finally:
            await daemon.close()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_another_vocabulary_on_the_real_model_resets_with_a_notice(tmp_path: Path, tiny_model: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from appliance.engine import tinymodel

    path = tmp_path / "tiny.gguf"
    shutil.copy(tiny_model, path)
    vocab = tinymodel.build_vocabulary()
    bigger = tinymodel.Vocabulary((*vocab.tokens, "▁zyzzyva"), (*vocab.scores, 0.0),
                                  (*vocab.types, vocab.types[-1]))
    monkeypatch.setattr(tinymodel, "build_vocabulary", lambda: bigger)
    other = tinymodel.write_tiny_model(tmp_path / "bigger.gguf", layers=2, dim=128, seed=3)
    daemon = real_daemon(tmp_path, path)

    async def main() -> None:
        try:
            agent = await daemon.register("a", "tiny")
            await daemon.decode("a", 8, "Once upon a time")
            daemon.apply_config(make_config(tmp_path, [{"name": "tiny", "path": str(other), "n_ctx": 256}]))
            assert "1 agents' conversations reset" in await daemon.reload_model("tiny")
            assert agent.conversation.tokens == []
            result = await daemon.decode("a", 4, "Hello")
            assert result.notice == vocabulary_notice("tiny") and result.generation.generated_tokens == 4
            assert len(agent.conversation.tokens) == result.generation.prompt_tokens + 4
            assert (await daemon.decode("a", 2, "")).notice is None
        finally:
            await daemon.close()

    asyncio.run(asyncio.wait_for(main(), 120))
