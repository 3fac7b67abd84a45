"""The hot pool's demand sees the queue, in the daemon on the real tiny model: 8 clients at once (stateless turns of
about 60 + 128 tokens, one connection each) in the 1024-cell initial pool of 8 live sequences make it grow once,
while the first ones decode,
after which all 8 run live together; a request longer than the pool grows the pool in place instead of building a
cold context beside it."""

from __future__ import annotations

import asyncio
import functools
from pathlib import Path

import pytest
import yaml

from appliance.config.validate import parse_config
from appliance.daemon.core import Daemon, context_key
from appliance.daemon.devices import FakeDevice
from appliance.engine.adaptive import INITIAL_POOL, initial_pool
from appliance.engine.runtime import Engine

N_CTX = 2048
AGENTS = 8
TOKENS = 128  # with a 60-token prompt, 8 turns need more than the initial pool
BURST_CTX = 4096  # room for a grown pool beside the initial one
INITIAL = initial_pool(BURST_CTX, AGENTS)


def config_for(tmp_path: Path, model: Path, slots: int = AGENTS, n_ctx: int = N_CTX) -> object:
    text = {"data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "model_dirs": [str(model.parent)],
            "engine": {"warmup_runs": 0, "live_slots": slots, "threads": 1},
            "models": [{"name": "m", "path": str(model), "n_ctx": n_ctx}]}
    return parse_config(yaml.safe_dump(text), base_dir=tmp_path)


def prompt(agent: int, turn: int) -> str:
    return " ".join(f"agent{agent} turn{turn} word{n}" for n in range(15))  # about 60 tokens


def test_eight_clients_run_live_together_after_one_growth(tmp_path: Path, tiny_model: Path) -> None:
    async def scenario() -> None:
        daemon = Daemon(config_for(tmp_path, tiny_model, n_ctx=BURST_CTX), FakeDevice(8 * 2**30), Engine(2))
        try:
            await daemon.complete("m", 1, "Hello")  # loaded
            model = daemon.models["m"]
            runtime = model.runtime
            assert runtime is not None and runtime.pool_cells == INITIAL
            live: list[int] = []

            def on_token(token: object) -> None:  # engine thread: the requests decoding together now
                live.append(len(runtime.slots.requests))

            async def burst(turn: int) -> list[int]:
                live.clear()
                results = await asyncio.gather(*(daemon.complete("m", TOKENS, prompt(agent, turn), on_token=on_token,
                                                                  queue=("client", agent)) for agent in range(AGENTS)))
                assert all(result.generation.generated_tokens > 0 for result in results)
                if model.retuning is not None:
                    await model.retuning
                return list(live)

            first = await burst(0)
            assert first[0] < AGENTS  # the initial pool held only some of them: the others waited for cells ...
            assert max(first) == AGENTS  # ... and joined the ones still in flight once the pool grew
            assert runtime.pool_cells >= AGENTS * (TOKENS + 60)  # grown for all 8 (in flight + waiting) ...
            assert daemon.adaptive.switches == 1  # ... in one step
            grown = runtime.pool_cells
            assert daemon.ledger.reservations()[context_key("m")] == daemon.adaptive.context_bytes(model, grown)
            for turn in (1, 2):
                seen = await burst(turn)
                assert max(seen) == AGENTS  # every agent decodes in the same steps
                assert model.admission.waiting_cells == 0
            assert daemon.adaptive.switches == 1 and runtime.pool_cells == grown  # no further resize
            assert daemon.adaptive.draining == set()
        finally:
            await daemon.close()

    asyncio.run(scenario())


def test_the_requests_that_waited_for_the_grown_pool_start_together(tmp_path: Path, tiny_model: Path) -> None:
    """The first burst after start: 8 clients at once, the initial pool (1024 cells) holds some of them. Those that
    waited for cells start together once the pool grew (as many try at once as there are free sequences) and their
    prompts go into the same step, so their first tokens come at one step (two at most, should the engine thread take
    a step between their starts). The old engine started them one per step behind each other (only the head of the
    queue tried, and a step's prompt tokens beside a stream were capped at 64 in all): 5 distinct steps here."""
    async def scenario() -> None:
        daemon = Daemon(config_for(tmp_path, tiny_model, n_ctx=BURST_CTX), FakeDevice(8 * 2**30), Engine(2))
        try:
            await daemon.complete("m", 1, "Hello")  # loaded
            runtime = daemon.models["m"].runtime
            assert runtime is not None and runtime.pool_cells == INITIAL
            steps = 0
            stepped = runtime.step

            def counted(*args: object) -> object:  # engine thread
                nonlocal steps
                steps += 1
                return stepped(*args)

            runtime.step = counted  # type: ignore[method-assign]
            first: dict[int, int] = {}

            def on_token(agent: int, token: object) -> None:  # engine thread: the step of the agent's first token
                first.setdefault(agent, steps)

            results = await asyncio.gather(*(daemon.complete("m", TOKENS, prompt(agent, 0),
                                                             on_token=functools.partial(on_token, agent),
                                                             queue=("client", agent)) for agent in range(AGENTS)))
            assert all(result.generation.generated_tokens > 0 for result in results)
            assert sorted(first) == list(range(AGENTS))
            assert daemon.adaptive.switches == 1 and runtime.pool_cells >= AGENTS * (TOKENS + 60)
            waited = sorted(step for step in first.values() if step > min(first.values()))
            assert waited, "every request fitted the first pool: nothing waited for cells"
            assert len(set(waited)) <= 2, waited
        finally:
            await daemon.close()

    asyncio.run(scenario())


@pytest.mark.parametrize(("words", "beside"), [(300, True), (590, False)])
def test_a_request_longer_than_the_pool_grows_the_pool_without_a_cold_context(tmp_path: Path, tiny_model: Path,
                                                                            words: int, beside: bool) -> None:
    """About 870 tokens: 512 + 1280 cells fit in n_ctx 2048, so the grown pool is built beside the live one. About
    1700 tokens: 512 + 1792 do not, so the live context is freed first (its conversation parked) and the model's
    ledger bytes never pass the weights and the grown pool. 4 live sequences: the initial pool is 512 cells."""
    async def scenario() -> None:
        daemon = Daemon(config_for(tmp_path, tiny_model, slots=4), FakeDevice(8 * 2**30), Engine(2))
        try:
            await daemon.register("a", "m")
            await daemon.decode("a", 4, "Hello world")  # a live conversation in the small pool
            model = daemon.models["m"]
            runtime = model.runtime
            assert runtime is not None and runtime.pool_cells == INITIAL_POOL
            weights = daemon.ledger.reservations()["m"]
            ledger_peak = 0

            async def watch_ledger() -> None:
                nonlocal ledger_peak
                while True:
                    ledger_peak = max(ledger_peak, daemon.model_bytes(model))
                    await asyncio.sleep(0)

            held: list[int] = []

            def on_token(token: object) -> None:  # engine thread: the contexts the model holds meanwhile
                held.append(runtime.pool_cells + runtime.cold_cells)

            watcher = asyncio.ensure_future(watch_ledger())
            long_text = " ".join(f"word{n % 97}" for n in range(words))
            try:
                result = await daemon.decode("a", 8, long_text, on_token=on_token)
            finally:
                watcher.cancel()
            assert result.generation.generated_tokens == 8
            assert daemon.adaptive.colds == 0 and runtime.cold_cells == 0  # no cold context was built
            grown = runtime.pool_cells
            assert grown >= result.generation.prompt_tokens + 8
            assert (INITIAL_POOL + grown <= N_CTX) is beside
            assert held and max(held) == grown  # it decoded in the grown hot pool
            assert daemon.ledger.reservations()[context_key("m")] == daemon.adaptive.context_bytes(model, grown)
            if not beside:
                assert ledger_peak <= weights + daemon.adaptive.context_bytes(model, grown)
            again = await daemon.decode("a", 4, " and more")  # the conversation goes on in the grown pool
            assert again.generation.generated_tokens == 4
        finally:
            await daemon.close()

    asyncio.run(scenario())
