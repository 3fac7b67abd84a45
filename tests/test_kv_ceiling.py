"""The adaptive engine's KV memory stays within what the fixed strategy preallocates: a growth goes no larger than
what can be built within ``n_ctx`` cells with the conversations and host buffers there are now (pure), the tuner
holds to that ceiling, and a conversation restored into the context does not keep a second copy of its cells in host
RAM beside another's (real model)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from appliance.config.validate import parse_config
from appliance.daemon import hostkv
from appliance.daemon.adaptive import fitted
from appliance.daemon.core import Daemon
from appliance.daemon.devices import FakeDevice
from appliance.daemon.diskkv import DiskTier
from appliance.engine import tuning
from appliance.engine.adaptive import Settings, Tuner, Tuning
from appliance.engine.interface import Conversation
from appliance.engine.runtime import Engine, Runtime
from appliance.engine.tinymodel import write_tiny_model

SETTINGS = Settings(adaptive=True, window_size=16, sample_rate=1, hot_pool_slack=1.2, plan_boundaries=(128, 512),
                    thread_idle_thresholds=(60, 30), fixed_threads=2, pinned_threads=False,
                    live_slots=4)
N_CTX = 16384
WIDE_N_CTX = 4096


def test_a_growth_that_would_hold_two_copies_past_n_ctx_is_capped_or_refused() -> None:
    # 4 agents hold 9000 cells in a 9472-cell pool: rebuilt, the new pool and their parked states pass n_ctx; built
    # beside, the two pools and the move's buffer do: the pool stays.
    assert tuning.growth_ceiling(9472, N_CTX, live=9000, largest=2400, parked=0, reused=0) == 9472
    # Little is live: a rebuild may go up to n_ctx less what it parks, in steps of 256.
    assert tuning.growth_ceiling(512, N_CTX, live=300, largest=300, parked=0, reused=0) == 15872
    # A full pool: rebuilt, its 2048 cells go to host RAM and back (beside, the pool and the move's buffer stay).
    assert tuning.growth_ceiling(2048, N_CTX, live=2048, largest=100, parked=0, reused=0) == 14336
    # Parked states and reuse buffers take their share of n_ctx either way.
    assert tuning.growth_ceiling(2048, N_CTX, live=1000, largest=600, parked=4000, reused=0) == 11264
    assert tuning.growth_ceiling(2048, N_CTX, live=1000, largest=600, parked=4000, reused=1000) == 10240
    # Never past n_ctx, never below the live pool.
    assert tuning.growth_ceiling(256, 1024, live=0, largest=0, parked=0, reused=0) == 1024
    assert tuning.growth_ceiling(4096, 4096, live=4000, largest=4000, parked=5000, reused=0) == 4096


def test_growth_ceiling_refuses_figures_out_of_range() -> None:
    with pytest.raises(ValueError, match="current, n_ctx and granularity"):
        tuning.growth_ceiling(0, N_CTX, live=0, largest=0, parked=0, reused=0)
    with pytest.raises(ValueError, match="live, largest, parked and reused"):
        tuning.growth_ceiling(512, N_CTX, live=0, largest=0, parked=-1, reused=0)


def test_a_context_is_built_beside_only_when_the_host_buffers_fit_too() -> None:
    assert tuning.builds_beside(512, 1280, 2048) is True
    assert tuning.builds_beside(512, 1280, 2048, 256) is True
    assert tuning.builds_beside(512, 1280, 2048, 257) is False
    with pytest.raises(ValueError, match="held must be at least 0"):
        tuning.builds_beside(512, 1280, 2048, -1)


def test_the_tuner_asks_for_no_pool_past_its_ceiling() -> None:
    tuner = Tuner(SETTINGS, N_CTX, 2)
    tuner.applied(Tuning(2048, "S", 2))
    assert tuner.queue_demand(12000) is True  # 12000 x 1.2 -> 14592 cells
    assert tuner.held_floor() == 14592
    tuner.limit(8192)
    assert tuner.held_floor() == 8192  # the held floor comes down to what can be built
    assert tuner.decide(2000).pool_cells == 8192
    assert tuner.queue_demand(13000) is False  # the ceiling holds the queue's demand too
    tuner.limit(1024)  # below the live pool: the pool stays, it is not a shrink
    assert tuner.ceiling == 2048 and tuner.decide(2000).pool_cells == 2048
    assert tuner.queue_demand(13000) is False
    tuner.limit(N_CTX * 2)  # never past n_ctx
    assert tuner.ceiling == N_CTX
    assert tuner.queue_demand(13000) is True and tuner.decide(2000).pool_cells == 15616
    with pytest.raises(ValueError, match="ceiling must be at least 1"):
        tuner.limit(0)


def test_at_most_one_live_conversation_keeps_its_host_buffer(tiny_model: Path) -> None:
    runtime = Runtime(tiny_model, n_ctx=512, n_gpu_layers=0, n_threads=1, live_slots=2)
    try:
        a, b = Conversation(), Conversation()
        runtime.generate(a, "Hello there, agent a", 4)
        runtime.generate(b, "Hello there, agent b", 4)
        runtime.park(a)
        runtime.park(b)
        assert a.where == b.where == "host" and a.buffer is not None and b.buffer is not None
        assert runtime.slots.host_cells() == (a.n_evaluated + b.n_evaluated, 0)
        runtime.generate(a, " more", 2)  # restored: it keeps its buffer for its next park
        assert a.where == "device" and a.buffer is not None
        assert runtime.slots.host_cells() == (b.n_evaluated, a.n_evaluated)
        runtime.generate(b, " more", 2)  # restored too: a's buffer goes, b keeps its own
        assert a.where == b.where == "device"
        assert a.buffer is None and b.buffer is not None
        assert runtime.slots.host_cells() == (0, b.n_evaluated)
        runtime.park(b)  # it grew since: a larger buffer
        kept = b.buffer
        assert kept is not None and runtime.slots.host_cells() == (b.n_evaluated, 0)
        assert runtime.slots.restore(b) and b.buffer is kept
        runtime.park(b)  # a swap back and forth writes into the buffer it kept
        assert b.buffer is kept
        before = list(b.tokens)
        assert runtime.generate(b, " again", 2).generated_tokens == 2
        assert b.tokens[:len(before)] == before and b.buffer is kept
        runtime.park(a)  # a parks into a new buffer: one parked state, one buffer kept for reuse
        assert a.buffer is not None and a.where == "host"
        assert runtime.slots.host_cells() == (a.n_evaluated, b.n_evaluated)
        runtime.slots.keep_buffers = False  # as the adaptive engine's pools: a restore lets its buffer go
        runtime.generate(a, " last", 2)
        assert a.where == "device" and a.buffer is None and b.buffer is None
        assert runtime.slots.host_cells() == (0, 0)
    finally:
        runtime.close()


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """4 layers x 512 at 4096 cells: 8 KiB of f16 KV cache per cell."""
    path = tmp_path_factory.mktemp("ceiling") / "wide.gguf"
    write_tiny_model(path, layers=4, dim=512, n_ctx_train=WIDE_N_CTX, seed=3)
    return path


def test_the_daemon_does_not_grow_a_pool_past_what_its_conversations_leave_of_n_ctx(tmp_path: Path,
                                                                                     wide_model: Path) -> None:
    """Two agents of 1448 and 724 cells: a pool holding both would have to be built with both in host RAM beside
    it (a rebuild) or beside the live pool (and the parked one), more than the fixed strategy's n_ctx either way. The
    pool holds one at a time (the other waits parked), even when the queue asks for every cell."""
    async def scenario() -> None:
        text = {"data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "model_dirs": [str(wide_model.parent)],
                "engine": {"warmup_runs": 0, "adaptive_sample_rate": 1, "adaptive_window_size": 8},
                "models": [{"name": "m", "path": str(wide_model), "n_ctx": WIDE_N_CTX}]}
        daemon = Daemon(parse_config(yaml.safe_dump(text), base_dir=tmp_path), FakeDevice(8 * 2**30), Engine(2))
        try:
            await daemon.register("a", "m")
            await daemon.register("b", "m")
            model = daemon.models["m"]
            for agent in ("a", "b", "a"):
                result = await daemon.decode(agent, 4, " ".join(f"word{n % 97}" for n in range(250)))
                assert result.generation.generated_tokens == 4
                while model.retuning is not None and not model.retuning.done():
                    await model.retuning
            runtime = model.runtime
            assert runtime is not None
            a, b = (daemon.agents[agent].conversation for agent in ("a", "b"))
            assert (a.where, b.where) == ("device", "host"), (runtime.pool_cells, a, b)
            grown = runtime.pool_cells
            both = a.n_evaluated + b.n_evaluated
            assert both > grown  # the pool does not hold both ...
            assert tuning.round_up(both, 256) + both > WIDE_N_CTX  # ... and one that does, built, passes n_ctx
            daemon.adaptive.blocked(model, WIDE_N_CTX)  # the queue asks for every cell
            if model.retuning is not None:
                await model.retuning
            assert runtime.pool_cells == grown and model.tuner is not None and model.tuner.ceiling == grown
            assert a.where == "device" and b.where == "host"
            assert not runtime.slots.keep_buffers and a.buffer is None  # an adaptive pool keeps no reuse buffer
            assert runtime.slots.host_cells() == (b.n_evaluated, 0)
        finally:
            await daemon.close()

    asyncio.run(scenario())


def test_the_daemon_keeps_an_adaptive_pool_and_its_parked_states_within_n_ctx(tmp_path: Path,
                                                                               wide_model: Path) -> None:
    """Four agents of two ~490-cell turns each hold almost all of the fixed strategy's n_ctx between them (about
    3,950 cells of 4096): the pool holds some, the rest are parked, and more than the pool leaves of n_ctx would be
    parked beside it. After every decode the pool and the host buffers together hold at most n_ctx cells' worth (what
    the fixed strategy holds: its context, its conversations within it), the states past that went to the disk tier,
    and a state written to disk comes back from it."""
    async def scenario() -> None:
        text = {"data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "model_dirs": [str(wide_model.parent)],
                "engine": {"warmup_runs": 0, "adaptive_sample_rate": 1, "adaptive_window_size": 8},
                "models": [{"name": "m", "path": str(wide_model), "n_ctx": WIDE_N_CTX}]}
        daemon = Daemon(parse_config(yaml.safe_dump(text), base_dir=tmp_path), FakeDevice(8 * 2**30), Engine(2))
        daemon.attach_durability(None, DiskTier(tmp_path / "kv", 2**30))
        prompt = " ".join(f"word{n % 97}" for n in range(170))
        names = ("a", "b", "c", "d")
        try:
            for name in names:
                await daemon.register(name, "m")
            model = daemon.models["m"]
            sources: list[str] = []
            for turn in range(2):
                for name in names:
                    result = await daemon.decode(name, 4, prompt)
                    assert result.generation.generated_tokens == 4
                    sources.append(result.restored_from)
                    while model.retuning is not None and not model.retuning.done():
                        await model.retuning
                    runtime = model.runtime
                    assert runtime is not None
                    host = daemon.snapshot()["host_kv"]["parked_bytes"]  # none before the first swap
                    assert host <= (WIDE_N_CTX - runtime.pool_cells) * model.kv_bytes_per_token, (turn, name)
            convs = [daemon.agents[name].conversation for name in names]
            assert 3 * WIDE_N_CTX // 4 < sum(len(conv.tokens) for conv in convs) <= WIDE_N_CTX
            assert daemon.counters["disk_kv_spills"] > 0 and "disk" in sources  # spilled, then read back
            assert daemon.counters["host_kv_drops"] == 0  # with a disk tier nothing is lost
        finally:
            await daemon.close()

    asyncio.run(scenario())


def test_the_pool_cap_is_what_the_pool_leaves_of_n_ctx_and_what_the_fixed_strategy_would_park() -> None:
    four = [4000, 3500, 3300, 3000]  # 13,800 cells: the fixed strategy's 16,384 hold them all
    assert hostkv.pool_cap(16384, 8704, four, 4, 36864) == 7680 * 36864
    assert hostkv.pool_cap(4096, 4096, [2000, 2000], 4, 8192) == 0 and hostkv.pool_cap(4096, 5000, [], 4, 8192) == 0
    # Past n_ctx: the fixed strategy parks what its context cannot hold, and so may the adaptive one.
    assert hostkv.pool_cap(4096, 1024, [3000, 3000], 4, 8192) == (3072 + 1904) * 8192
    assert hostkv.pool_cap(4096, 4096, [3000, 3000], 4, 8192) == 1904 * 8192
    # Past its sequences: with one live slot the fixed strategy parks all but one conversation.
    assert hostkv.pool_cap(256, 256, [20, 30, 25], 1, 100) == 45 * 100
    assert hostkv.pool_cap(256, 128, [20, 30, 25], 2, 100) == (128 + 20) * 100
    assert hostkv.pool_cap(4096, 512, [], 4, 0) == 0  # no state saved yet: nothing is held either
    with pytest.raises(ValueError, match="live_slots at least 1"):
        hostkv.pool_cap(4096, -1, [], 4, 8192)
    with pytest.raises(ValueError, match="live_slots at least 1"):
        hostkv.pool_cap(4096, 512, [10], 0, 8192)


class CountingFits:
    """The daemon's side of :func:`~appliance.daemon.adaptive.fitted`: counts the host-KV fits it is asked for."""

    def __init__(self) -> None:
        self.fits = 0

    def fit_host_kv(self, reserve: int = 0) -> list[str]:
        self.fits += 1
        return ["dropped"]


def test_a_move_fits_host_kv_in_the_same_job_and_no_move_skips_it() -> None:
    daemon = CountingFits()
    parked = [Conversation()]

    def move(result: list[Conversation] | None) -> list[Conversation] | None:
        return result

    assert fitted(daemon, move, None) == (None, []) and daemon.fits == 0  # nothing changed
    assert fitted(daemon, move, []) == ([], ["dropped"]) and daemon.fits == 1  # switched: the pool's cap moved
    assert fitted(daemon, move, parked) == (parked, ["dropped"]) and daemon.fits == 2
