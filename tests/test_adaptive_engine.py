"""The adaptive engine on a real model (issue #12, SPEC E2-E5): the hot pool shrinks and RSS with it, a long request
runs in a cold context that is freed after it, and the plan and the threads really change the live context (read
back from llama.cpp); in the daemon the ledger follows every resize and a reload switches strategies live."""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Any

import pytest
import yaml

from appliance.config.validate import Config, parse_config
from appliance.daemon.adaptive import cold_key, next_key
from appliance.daemon.core import Daemon, context_key
from appliance.daemon.devices import FakeDevice
from appliance.engine import plans
from appliance.engine.adaptive import FIXED, MIN_SAMPLES, CpuShare, Tuning, initial_plan
from appliance.engine.interface import Conversation
from appliance.engine.runtime import Engine, Runtime

N_CTX = 4096


def rss() -> int:
    gc.collect()
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * 4096


def long_prompt(words: int) -> str:
    return " ".join(f"word{n % 97}" for n in range(words))


def test_the_hot_pool_shrinks_rss_drops_and_a_long_request_runs_cold(wide_model: Path) -> None:
    text = long_prompt(400)
    turns = [("Hello world", 8), (" again", 8), (text, 8), (" more", 4)]
    reference = Runtime(wide_model, n_ctx=N_CTX, n_gpu_layers=0, n_threads=2, live_slots=2)
    try:
        ref_conv = Conversation()
        expected = [reference.generate(ref_conv, prompt, n).text for prompt, n in turns]
    finally:
        reference.close()
    runtime = Runtime(wide_model, n_ctx=N_CTX, n_gpu_layers=0, n_threads=2, live_slots=2)
    try:
        conv = Conversation()
        assert runtime.generate(conv, *turns[0]).text == expected[0]
        full = rss()
        assert runtime.pool_cells == N_CTX and runtime.tuning.plan == FIXED
        parked = runtime.retune(Tuning(256, "S", 2))
        assert parked == []  # its cells fit in 256: the conversation was carried over, not parked
        assert runtime.pool_cells == 256 and runtime.context is not None and runtime.context.n_ctx == 256
        small = rss()
        assert full - small > 16 * 2**20, (full, small)  # 3840 cells x 8 KiB of KV at least
        # The conversation goes on in the new context exactly as it would have in the old one.
        assert runtime.generate(conv, *turns[1]).text == expected[1]
        # A request longer than the whole hot pool runs in a cold context of its size, freed after it.
        assert runtime.generate(conv, *turns[2]).text == expected[2]
        assert runtime.cold is None and runtime.cold_cells == 0
        assert conv.where == "host" and conv.n_evaluated > 256  # too long for the hot pool: it stays parked
        assert rss() - small < 12 * 2**20, (rss(), small)  # the cold context's memory went back (its state: 3 MiB)
        assert runtime.generate(conv, *turns[3]).text == expected[3]
    finally:
        runtime.close()


def test_the_plan_and_the_threads_change_the_live_context_as_llama_cpp_reports_it(wide_model: Path) -> None:
    runtime = Runtime(wide_model, n_ctx=N_CTX, n_gpu_layers=0, n_threads=2, live_slots=4,
                      tuning=Tuning(512, "S", 2))
    try:
        context = runtime.context
        assert context is not None
        expected = plans.plan_for("S", 512, 4)
        assert (context.n_batch, context.n_ubatch) == (expected.n_batch, expected.n_ubatch)
        conv = Conversation()
        runtime.generate(conv, "Hello world", 4)
        runtime.prepare(Tuning(1024, "L", 2))  # built beside the live context ...
        assert runtime.context is context and runtime.prepared == Tuning(1024, "L", 2)
        assert runtime.switch() == []  # ... and swapped in between requests
        large = plans.plan_for("L", 1024, 4)
        assert runtime.context is not context and runtime.context is not None
        assert (runtime.context.n_ctx, runtime.context.n_batch, runtime.context.n_ubatch) == \
            (1024, large.n_batch, large.n_ubatch)
        assert runtime.plan.n_ubatch == large.n_ubatch
        assert runtime.threads == 2
        runtime.set_threads(1)
        assert runtime.threads == 1 and runtime.context.threads == 1 and runtime.tuning.threads == 1
        assert runtime.generate(conv, " again", 4).generated_tokens == 4
    finally:
        runtime.close()


def daemon_config(tmp_path: Path, model: Path, **engine: object) -> object:
    text = {"data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "model_dirs": [str(model.parent)],
            "engine": {"warmup_runs": 0, "adaptive_sample_rate": 1, "adaptive_window_size": 8, **engine},
            "models": [{"name": "m", "path": str(model), "n_ctx": N_CTX}]}
    return parse_config(yaml.safe_dump(text), base_dir=tmp_path)


def test_the_daemon_resizes_the_pool_to_the_profile_and_the_ledger_follows(tmp_path: Path, wide_model: Path) -> None:
    async def scenario() -> None:
        config = daemon_config(tmp_path, wide_model)  # threads not pinned: the adaptive loop chooses them
        daemon = Daemon(config, FakeDevice(8 * 2**30), Engine(2))
        try:
            agent = await daemon.register("a", "m")
            model = agent.model
            assert model.runtime is not None and model.runtime.pool_cells == 512
            assert daemon.ledger.reservations()[context_key("m")] == daemon.adaptive.context_bytes(model, 512)
            for _ in range(MIN_SAMPLES):  # long turns: the P90 need grows past the pool
                await daemon.complete("m", 8, long_prompt(700))
            await model.retuning
            assert model.runtime.pool_cells > 512 and model.runtime.tuning.plan == "L"
            grown = model.runtime.pool_cells
            assert daemon.ledger.reservations()[context_key("m")] == daemon.adaptive.context_bytes(model, grown)
            assert next_key("m") not in daemon.ledger.reservations()
            for _ in range(8):  # then a window of short ones: it shrinks back
                await daemon.complete("m", 8, "Hello world")
                if model.retuning is not None:
                    await model.retuning
            assert model.runtime.pool_cells < grown and model.runtime.tuning.plan == "S"
            small = model.runtime.pool_cells
            assert daemon.ledger.reservations()[context_key("m")] == daemon.adaptive.context_bytes(model, small)
            # Threads follow an injected CPU reading: another process takes one of two cores.
            daemon.adaptive.cores = 2
            model.tuner.usable_cores = 2
            daemon.adaptive.cpu = CpuShare(45.0, 2)
            daemon.adaptive.schedule(model, threads_only=True)
            await model.retuning
            assert await daemon.engine.call(getattr, model.runtime, "threads") == 1  # read back from llama.cpp
            result = await daemon.decode("a", 4, "Hello")
            assert (result.plan, result.threads) == ("S", 1)
            assert result.peak_memory_bytes == daemon.model_bytes(model)
            snapshot = daemon.snapshot()
            record = snapshot["contexts"][0]
            assert (record["pool_cells"], record["plan"], record["threads"]) == (small, "S", 1)
            assert snapshot["profiles"]["m"]["in_window"] == 8
        finally:
            await daemon.close()

    asyncio.run(scenario())


def test_a_long_request_runs_cold_in_the_daemon_and_its_bytes_are_released(tmp_path: Path, wide_model: Path) -> None:
    async def scenario() -> None:
        # async_switch off: the hot pool cannot grow before the request (tests/test_adaptive_queue.py: it grows)
        config = daemon_config(tmp_path, wide_model, threads=2, async_switch=False)
        daemon = Daemon(config, FakeDevice(8 * 2**30), Engine(2))
        try:
            await daemon.register("a", "m")
            model = daemon.models["m"]
            seen: list[int] = []

            def on_token(token: object) -> None:
                seen.append(daemon.ledger.reservations().get(cold_key("m"), 0))

            result = await daemon.decode("a", 6, long_prompt(800), on_token=on_token)
            assert result.generation.generated_tokens == 6 and result.plan == "L"
            cells = -(-(result.generation.prompt_tokens + 6) // 256) * 256  # its need, in llama.cpp's steps
            assert cells > 512
            assert seen and all(nbytes == daemon.adaptive.context_bytes(model, cells) for nbytes in seen)
            assert cold_key("m") not in daemon.ledger.reservations() and model.runtime.cold_cells == 0
            assert daemon.snapshot()["engine"]["cold_requests"] == 1
            again = await daemon.decode("a", 4, " and more")  # the conversation goes on (cold again: too long)
            assert again.generation.generated_tokens == 4
        finally:
            await daemon.close()

    asyncio.run(scenario())


def test_a_reload_switches_between_the_fixed_and_the_adaptive_strategy_live(tmp_path: Path, wide_model: Path) -> None:
    async def scenario() -> None:
        daemon = Daemon(daemon_config(tmp_path, wide_model, threads=2), FakeDevice(8 * 2**30), Engine(2))
        try:
            await daemon.register("a", "m")
            model = daemon.models["m"]
            before = await daemon.decode("a", 6, "Hello world")
            assert model.runtime.pool_cells == 512 and before.plan == initial_plan(4) == "M"  # live_slots 4
            daemon.apply_config(daemon_config(tmp_path, wide_model, threads=2, adaptive=False))
            await model.retuning
            assert model.runtime.pool_cells == N_CTX and model.runtime.tuning == Tuning(N_CTX, FIXED, 2)
            assert daemon.ledger.reservations()[context_key("m")] == daemon.adaptive.context_bytes(model, N_CTX)
            fixed = await daemon.decode("a", 6, " again")
            assert fixed.plan == "fixed" and fixed.generation.generated_tokens == 6
            daemon.apply_config(daemon_config(tmp_path, wide_model, threads=2, adaptive=True))
            await model.retuning
            assert model.runtime.pool_cells == 512 and model.runtime.tuning.plan == "M"
        finally:
            await daemon.close()

    asyncio.run(scenario())


def test_warm_up_runs_seed_the_profile_off_the_request_path(tmp_path: Path, wide_model: Path) -> None:
    async def scenario() -> None:
        config = daemon_config(tmp_path, wide_model, threads=2, warmup_runs=4)
        daemon = Daemon(config, FakeDevice(8 * 2**30), Engine(2))
        try:
            await daemon.register("a", "m")
            assert daemon.snapshot()["engine"]["warming"] is True
            await asyncio.gather(*daemon.adaptive.tasks)
            model = daemon.models["m"]
            assert len(model.tuner.profile) == 4 and model.tuner.profile.observed == 0
            assert daemon.snapshot()["engine"]["warming"] is False
            assert daemon.counters["decodes"] == 0  # not a client's request
            result = await daemon.decode("a", 4, "Hello")
            assert result.generation.generated_tokens == 4
        finally:
            await daemon.close()

    asyncio.run(scenario())


def test_warm_up_runs_are_short_turns_that_keep_plan_s(tmp_path: Path, tiny_model: Path) -> None:
    """The warm-up prompts are sized in tokens under the first plan boundary, whatever the vocabulary makes of a
    word (the tiny model's about 4 tokens a ``warmN`` word: 64 words were 257 tokens, and the seeded profile rebuilt
    the context with plan M before any client came)."""
    async def scenario() -> None:
        text = {"data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "model_dirs": [str(tiny_model.parent)],
                "engine": {"warmup_runs": 4, "live_slots": 1},
                "models": [{"name": "m", "path": str(tiny_model), "n_ctx": 2048}]}
        daemon = Daemon(parse_config(yaml.safe_dump(text), base_dir=tmp_path), FakeDevice(8 * 2**30), Engine(1))
        try:
            await daemon.register("a", "m")
            await asyncio.gather(*daemon.adaptive.tasks)
            model = daemon.models["m"]
            if model.retuning is not None:
                await model.retuning
            inputs = [sample.input_tokens for sample in model.tuner.profile.window]
            assert len(inputs) == 4 and max(inputs) < 128 and len(set(inputs)) == 4, inputs
            assert model.runtime.tuning.plan == "S"
        finally:
            await daemon.close()

    asyncio.run(scenario())


def test_warm_up_runs_that_do_not_fit_a_small_context_are_skipped(tmp_path: Path, tiny_model: Path) -> None:
    """At n_ctx 64 the longer warm-up prompts (64 and 96 tokens) cannot fit: those runs are skipped, the others seed
    the profile, and no task ends with an exception nobody retrieves (it used to: CONTEXT_OVERFLOW)."""
    async def scenario() -> None:
        text = {"data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "model_dirs": [str(tiny_model.parent)],
                "engine": {"warmup_runs": 4, "live_slots": 1},
                "models": [{"name": "m", "path": str(tiny_model), "n_ctx": 64}]}
        daemon = Daemon(parse_config(yaml.safe_dump(text), base_dir=tmp_path), FakeDevice(8 * 2**30), Engine(1))
        try:
            await daemon.register("a", "m")
            tasks = list(daemon.adaptive.tasks)
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert not [r for r in results if isinstance(r, BaseException)], results
            model = daemon.models["m"]
            assert 1 <= len(model.tuner.profile) < 4  # the runs that fit
            result = await daemon.decode("a", 4, "Hello")
            assert result.generation.generated_tokens == 4
        finally:
            await daemon.close()

    asyncio.run(scenario())


def test_async_switch_off_rebuilds_inline_at_the_next_request(tmp_path: Path, wide_model: Path) -> None:
    async def scenario() -> None:
        config = daemon_config(tmp_path, wide_model, threads=2, async_switch=False)
        daemon = Daemon(config, FakeDevice(8 * 2**30), Engine(2))
        try:
            await daemon.register("a", "m")
            model = daemon.models["m"]
            for _ in range(MIN_SAMPLES):
                await daemon.complete("m", 4, long_prompt(700))
            await model.retuning
            assert model.pending is not None and model.runtime.pool_cells == 512  # waiting for a request
            result = await daemon.decode("a", 4, "Hello")
            assert model.pending is None and model.runtime.pool_cells > 512 and result.plan == "L"
        finally:
            await daemon.close()

    asyncio.run(scenario())


def test_a_shrinking_pool_parks_the_least_recently_used_within_the_host_budget(tmp_path: Path) -> None:
    """On the fake engine: a pool switched to fewer cells than its live conversations hold parks the least recently
    used ones, and the host KV budget still holds (0 here: their parked state is dropped, never kept)."""
    from appliance.engine.fake import FakeEngine, ManualClock, fresh_text

    doc = {"data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "model_dirs": [str(tmp_path)],
           "resync_interval_s": 0, "host_kv_budget": 0,
           "engine": {"warmup_runs": 0, "live_slots": 4},
           "models": [{"name": "m", "path": str(tmp_path / "m.gguf"), "vram_bytes": "1GiB", "n_ctx": 2048}]}
    config = parse_config(yaml.safe_dump(doc), base_dir=tmp_path, check_files=False)

    async def scenario() -> None:
        daemon = Daemon(config, FakeDevice("8GiB", process_used=0), FakeEngine(), clock=ManualClock())
        try:
            for name in "abc":
                await daemon.register(name, "m")
                await daemon.decode(name, 8, f"agent {name} " * 10)  # 1 + 90 + 8 cells each
            model = daemon.models["m"]
            assert model.runtime.pool_cells == 512 and len(model.runtime.live) == 3
            assert await daemon.adaptive.switch(model, Tuning(256, "S", 1))
            assert model.runtime.pool_cells == 256 and len(model.runtime.live) == 2  # a (least recent) parked ...
            assert daemon.snapshot()["host_kv"]["parked_bytes"] == 0  # ... and dropped: the budget is 0
            assert daemon.counters["host_kv_drops"] == 1
            result = await daemon.decode("a", 4, "")  # re-evaluated from its tokens: the same text
            assert result.rebuilt and result.generation.text == fresh_text("agent a " * 10, 12)[8:]
        finally:
            await daemon.close()

    asyncio.run(scenario())


def test_a_reload_during_a_retune_is_retuned_after_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the fake engine: new engine settings arrive while a retune of the model is in progress (it decided under
    the old ones); the retune they ask for runs once that one ends, instead of being lost until the next sample."""
    from appliance.daemon.adaptive import AdaptiveLoop
    from appliance.engine.fake import FakeEngine, ManualClock

    def config_of(adaptive: bool) -> Config:
        doc = {"data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "model_dirs": [str(tmp_path)],
               "resync_interval_s": 0, "engine": {"warmup_runs": 0, "live_slots": 1, "adaptive": adaptive},
               "models": [{"name": "m", "path": str(tmp_path / "m.gguf"), "vram_bytes": "1GiB", "n_ctx": 2048}]}
        return parse_config(yaml.safe_dump(doc), base_dir=tmp_path, check_files=False)

    retune = AdaptiveLoop._retune
    released = asyncio.Event()
    reached = asyncio.Event()
    armed = asyncio.Event()  # the retunes before it (a sampled request's) are not the test's
    decided: list[bool] = []

    async def slow_retune(loop: AdaptiveLoop, model: object, threads_only: bool) -> None:
        await retune(loop, model, threads_only)  # type: ignore[arg-type]
        if not armed.is_set():
            return
        decided.append(loop.daemon.config.engine.adaptive)
        if len(decided) == 1:
            reached.set()
            await released.wait()  # still in progress when the reload comes

    monkeypatch.setattr(AdaptiveLoop, "_retune", slow_retune)

    async def retunes_ended(model: Any) -> None:
        """Until the model's retune and the ones it scheduled as it ended are over (no poll)."""
        while model.retuning is not None and not model.retuning.done():
            await asyncio.gather(model.retuning, return_exceptions=True)

    async def scenario() -> None:
        daemon = Daemon(config_of(True), FakeDevice("8GiB", process_used=0), FakeEngine(), clock=ManualClock())
        try:
            await daemon.register("a", "m")
            await daemon.decode("a", 4, "hello")
            model = daemon.models["m"]
            await retunes_ended(model)
            assert model.runtime.tuning.plan != FIXED
            armed.set()
            daemon.adaptive.schedule(model)
            await reached.wait()
            daemon.apply_config(config_of(False))  # the fixed strategy: asks for a retune while one runs
            assert model.runtime.tuning.plan != FIXED
            released.set()
            await retunes_ended(model)  # the one it asked for runs after it
            assert decided == [True, False]
            assert (model.runtime.tuning.plan, model.runtime.pool_cells) == (FIXED, 2048)
        finally:
            await daemon.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
