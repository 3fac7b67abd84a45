"""A hot pool grown while requests are in flight, on the real tiny model with flash attention off: the requests in
flight are carried into the grown context at a step boundary (their cells, sampler and pending tokens) and end with
exactly the tokens they would have produced without the growth, each streamed once and in order; in the daemon the
requests that waited for cells start in the grown pool while the first ones still decode, and the ledger holds the
grown pool's figure."""

from __future__ import annotations

import asyncio
import functools
import tracemalloc
import weakref
from pathlib import Path
from typing import Any

import pytest
import yaml

from appliance.config.validate import parse_config
from appliance.daemon.core import Daemon, context_key
from appliance.daemon.devices import FakeDevice
from appliance.engine import gguf_meta
from appliance.engine.adaptive import Tuning, initial_pool
from appliance.engine.interface import GREEDY, Conversation, Sampling, Token
from appliance.engine.runtime import Engine, Runtime
from appliance.engine.slots import Request

SMALL = 256
GROWN = 512
SEEDED = Sampling(temperature=0.9, top_k=0, seed=7)
"""A sampled request: its random stream must go on where it was (a sampler rebuilt from its seed would repeat it)."""
JOBS = (("The quick brown fox jumps over the lazy dog", 40, GREEDY),
        ("Once upon a time in a land far away there lived", 40, SEEDED),
        ("one two three four five six seven", 24, GREEDY))


class Streamed:
    """One request's streamed tokens, as its client sees them."""

    def __init__(self) -> None:
        self.tokens: list[Token] = []

    def __call__(self, token: Token) -> None:
        self.tokens.append(token)


def runtime_of(model: Path, pool: int) -> Runtime:
    return Runtime(model, n_ctx=2048, n_gpu_layers=0, n_threads=1, live_slots=4, flash_attention=False,
                   tuning=Tuning(pool, "S", 1))


def start_all(runtime: Runtime) -> tuple[list[Request], list[Streamed]]:
    streams = [Streamed() for _ in JOBS]
    requests = []
    for (prompt, n_tokens, sampling), stream in zip(JOBS, streams, strict=True):
        request = runtime.begin(Conversation(), prompt, n_tokens, sampling, on_token=stream)
        assert isinstance(request, Request)
        requests.append(request)
    return requests, streams


def run_out(runtime: Runtime, requests: list[Request]) -> None:
    while not all(request.done for request in requests):
        runtime.step()


def without_growth(model: Path) -> list[tuple[int, ...]]:
    runtime = runtime_of(model, SMALL)
    try:
        requests, _ = start_all(runtime)
        run_out(runtime, requests)
        return [request.generation.tokens for request in requests if request.generation is not None]
    finally:
        runtime.close()


@pytest.mark.parametrize("how", ["beside", "rebuild"])
@pytest.mark.parametrize("steps_before", [0, 1, 9])
def test_requests_in_flight_go_on_in_the_grown_pool_with_the_same_tokens(tiny_model: Path, how: str,
                                                                         steps_before: int) -> None:
    """Grown before the prompts were evaluated (0 steps), right after (1) or mid-generation (9); built beside the
    live context then swapped in, or rebuilt in its place (the live one freed first)."""
    expected = without_growth(tiny_model)
    runtime = runtime_of(tiny_model, SMALL)
    try:
        requests, streams = start_all(runtime)
        for _ in range(steps_before):
            runtime.step()
        assert not any(request.done for request in requests)
        before = runtime.context
        if how == "beside":
            runtime.prepare(Tuning(GROWN, "S", 1))
            parked = runtime.switch(carry=True)
        else:
            parked = runtime.rebuild(Tuning(GROWN, "S", 1), carry=True)
        assert parked == []
        assert runtime.context is not before and runtime.pool_cells == GROWN
        assert len(runtime.slots.requests) == len(JOBS)  # still in flight, in the grown context
        run_out(runtime, requests)
        for request, stream, tokens in zip(requests, streams, expected, strict=True):
            assert request.error is None and request.generation is not None
            assert request.generation.tokens == tokens  # nothing lost, repeated or sampled differently
            assert [token.index for token in stream.tokens] == list(range(len(tokens)))
            assert tuple(token.id for token in stream.tokens) == tokens
            assert "".join(token.text for token in stream.tokens) == request.generation.text
        conv = requests[0].conv
        assert runtime.slots.holds(conv) and conv.n_evaluated == len(conv.tokens) - 1  # its cells came along
        assert runtime.generate(conv, " and then", 4).generated_tokens == 4
    finally:
        runtime.close()


def test_a_switch_with_carry_holds_one_lifted_state_in_host_ram_at_a_time(tiny_model: Path) -> None:
    """The growth's ceiling counts one conversation's state in transit (``largest``): the requests in flight are
    lifted and landed one after the other, and each one's host copy is gone before the next one is lifted."""
    runtime = runtime_of(tiny_model, SMALL)
    try:
        requests, _ = start_all(runtime)
        for _ in range(3):
            runtime.step()
        old = runtime.context
        assert old is not None
        lift = old.lift
        alive: list[weakref.ref[Any]] = []
        seen: list[int] = []

        def watched_lift(seq_id: int) -> Any:
            seen.append(sum(ref() is not None for ref in alive))  # lifted states still held as this one starts
            lifted = lift(seq_id)
            alive.append(weakref.ref(lifted))
            return lifted

        old.lift = watched_lift  # type: ignore[method-assign]
        runtime.prepare(Tuning(GROWN, "S", 1))
        assert runtime.switch(carry=True) == []
        assert len(seen) == len(JOBS) and seen == [0] * len(JOBS)
        assert all(ref() is None for ref in alive)
        run_out(runtime, requests)
        assert all(request.error is None for request in requests)
    finally:
        runtime.close()


def test_a_switch_without_carry_still_waits_for_the_requests_in_flight(tiny_model: Path) -> None:
    runtime = runtime_of(tiny_model, SMALL)
    try:
        requests, _ = start_all(runtime)
        runtime.step()
        runtime.prepare(Tuning(GROWN, "S", 1))
        assert runtime.switch() is None and runtime.pool_cells == SMALL
        assert runtime.rebuild(Tuning(GROWN, "S", 1)) is None and runtime.pool_cells == SMALL
        run_out(runtime, requests)
        assert runtime.switch() == [] and runtime.pool_cells == GROWN
    finally:
        runtime.close()


AGENTS = 8
LONG = 4
BURST_CTX = 4096  # room for a grown pool beside the initial one
INITIAL = initial_pool(BURST_CTX, AGENTS)
LONG_TOKENS = INITIAL // LONG - 32  # with their ~25-token prompts the long ones fill most of the initial pool
LATE_TOKENS = 16


def config_for(tmp_path: Path, model: Path) -> object:
    text = {"data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "model_dirs": [str(model.parent)],
            "engine": {"warmup_runs": 0, "live_slots": AGENTS, "threads": 1, "flash_attention": False},
            "models": [{"name": "m", "path": str(model), "n_ctx": BURST_CTX}]}
    return parse_config(yaml.safe_dump(text), base_dir=tmp_path)


def prompt(agent: int) -> str:
    return " ".join(f"agent{agent} word{n}" for n in range(6))


def solo_texts(model: Path) -> list[str]:
    runtime = Runtime(model, n_ctx=2048, n_gpu_layers=0, n_threads=1, live_slots=1, flash_attention=False)
    try:
        return [runtime.generate(Conversation(), prompt(agent), LONG_TOKENS if agent < LONG else LATE_TOKENS).text
                for agent in range(AGENTS)]
    finally:
        runtime.close()


def test_requests_waiting_for_cells_start_while_the_first_ones_still_decode(tmp_path: Path, tiny_model: Path) -> None:
    """4 long requests fill most of the initial pool (1024 cells for 8 live sequences); 4 more arrive while they
    decode and wait for cells: the pool grows at once, the 4 late ones start in it and get their first token before
    any long one ends; every text is its solo text; the ledger holds the grown pool's figure."""
    solo = solo_texts(tiny_model)

    async def scenario() -> None:
        daemon = Daemon(config_for(tmp_path, tiny_model), FakeDevice(8 * 2**30), Engine(1))
        try:
            await daemon.complete("m", 1, "Hello")  # loaded
            model = daemon.models["m"]
            runtime = model.runtime
            assert runtime is not None and runtime.pool_cells == INITIAL
            streams = [Streamed() for _ in range(AGENTS)]
            started = asyncio.Event()
            loop = asyncio.get_running_loop()

            def on_long_token(stream: Streamed, token: Token) -> None:  # engine thread
                stream(token)
                if all(s.tokens for s in streams[:LONG]):
                    loop.call_soon_threadsafe(started.set)

            longs = [asyncio.ensure_future(daemon.complete("m", LONG_TOKENS, prompt(agent),
                                                           on_token=functools.partial(on_long_token, streams[agent]),
                                                           queue=("client", agent))) for agent in range(LONG)]
            await started.wait()
            assert runtime.pool_cells == INITIAL and len(runtime.slots.requests) == LONG
            lates = [asyncio.ensure_future(daemon.complete("m", LATE_TOKENS, prompt(agent), on_token=streams[agent],
                                                           queue=("client", agent))) for agent in range(LONG, AGENTS)]
            results = await asyncio.gather(*longs, *lates)
            if model.retuning is not None:
                await model.retuning
            ended = [stream.tokens[-1].timestamp for stream in streams[:LONG]]
            firsts = [stream.tokens[0].timestamp for stream in streams[LONG:]]
            assert max(firsts) < min(ended)  # the late ones started before the first ones ended
            assert [result.generation.text for result in results] == solo
            for result, stream in zip(results, streams, strict=True):
                tokens = result.generation.tokens
                assert [token.index for token in stream.tokens] == list(range(len(tokens)))
                assert tuple(token.id for token in stream.tokens) == tokens
            grown = runtime.pool_cells
            assert grown > INITIAL and daemon.adaptive.switches == 1
            assert daemon.ledger.reservations()[context_key("m")] == daemon.adaptive.context_bytes(model, grown)
            assert daemon.adaptive.draining == set()
        finally:
            await daemon.close()

    asyncio.run(scenario())


def test_a_request_carried_into_a_grown_pool_passes_through_host_ram_as_one_copy(tiny_model: Path) -> None:
    """A request in flight goes to the grown pool through host RAM as one copy of its cells: lifted into one
    buffer, landed from it in place (a second copy beside it, as a lift into bytes or a land that copies them
    again made, doubled the peak of a growth: 2 x 108 MiB for a 3084-cell conversation of the 12x768 model)."""
    runtime = runtime_of(tiny_model, SMALL * 4)
    try:
        request = runtime.begin(Conversation(), " ".join(f"word{n % 97}" for n in range(300)), 8, GREEDY)
        assert isinstance(request, Request) and request.seq_id is not None
        runtime.step()  # its prompt is in the context
        cells = runtime.context.cells(request.seq_id)
        one_copy = gguf_meta.kv_bytes(gguf_meta.read_model_shape(tiny_model), cells)
        assert one_copy > 2**20
        runtime.prepare(Tuning(GROWN * 4, "S", 1))
        tracemalloc.start()
        try:
            assert runtime.switch(carry=True) == []
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert runtime.pool_cells == GROWN * 4 and runtime.context.cells(request.seq_id) == cells
        assert one_copy <= peak < 1.25 * one_copy
        run_out(runtime, [request])
        assert request.error is None and request.generation is not None
    finally:
        runtime.close()
