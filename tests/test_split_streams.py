"""Split KV streams (SPEC E2): a context in which every live sequence has a KV stream of its own
(``BatchedContext(split=True)``, llama.cpp's ``kv_unified = false``), on the real tiny model; the adaptive engine's
choice of it (pure: :mod:`appliance.engine.tuning`, :class:`~appliance.engine.adaptive.Tuner`); the slots over a
split fake context; and the daemon switching a model's pool to split streams and back on a real model."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from test_adaptive_engine import daemon_config, long_prompt
from test_batched import N_BATCH, PROMPTS, THREADS, Run, assert_matches, finish, flash_off, solo, tokenize_all

from appliance.daemon.core import Daemon, context_key
from appliance.daemon.devices import FakeDevice
from appliance.engine import kvstreams, tuning
from appliance.engine.adaptive import MIN_SAMPLES, Settings, Tuner, Tuning, prompts_lighter
from appliance.engine.batched import BatchedContext, ModelWeights
from appliance.engine.fake import FakeContext, FakeEngine, FakeRuntime
from appliance.engine.interface import GREEDY, Conversation
from appliance.engine.profile import RequestSample
from appliance.engine.runtime import Engine
from appliance.engine.slots import ColdNeeded
from appliance.errors import ApplianceError


# -- the split context on llama.cpp -------------------------------------------------------------------
def test_sequences_in_split_streams_match_their_solo_runs(weights: ModelWeights) -> None:
    prompts = tokenize_all(weights, PROMPTS[:4])
    with flash_off(weights, n_ctx=1024, n_seq_max=4, n_batch=N_BATCH, n_threads=THREADS, split=True) as context:
        assert (context.split, context.n_ctx, context.seq_cells) == (True, 1024, 256)
        for seq_id, tokens in enumerate(prompts):
            context.add(seq_id, tokens, GREEDY, 20)
        runs: dict[int, Run] = {}
        finish(context, runs)
    for seq_id, tokens in enumerate(prompts):
        assert_matches(runs[seq_id], solo(weights, tokens, 20))


def test_a_split_context_refuses_a_claim_longer_than_its_stream_whatever_the_others_hold(
        weights: ModelWeights) -> None:
    tokens = weights.tokenize(PROMPTS[0], bos=True)
    with flash_off(weights, n_ctx=512, n_seq_max=2, n_batch=N_BATCH, n_threads=THREADS, split=True) as context:
        context.add(0, tokens, GREEDY, 256 - len(tokens))  # its whole stream
        context.add(1, tokens, GREEDY, 256 - len(tokens))  # the other's stream: untouched by the first
        context.cancel(1)
        with pytest.raises(ApplianceError) as caught:
            context.add(1, tokens, GREEDY, 257 - len(tokens))
        assert caught.value.code == "CONTEXT_OVERFLOW"
        assert caught.value.details == {"seq_cells": 256, "requested": 257}
        assert context.cells_claimed() == 256  # the refusal changed nothing
    with flash_off(weights, n_ctx=512, n_seq_max=2, n_batch=N_BATCH, n_threads=THREADS) as unified:
        unified.add(1, tokens, GREEDY, 257 - len(tokens))  # one pool: a sequence may take more than half


def test_a_split_context_has_256_cells_per_sequence(weights: ModelWeights) -> None:
    with pytest.raises(ApplianceError) as caught:
        BatchedContext(weights, n_ctx=1000, n_seq_max=4, n_batch=N_BATCH, split=True)
    assert caught.value.code == "BAD_REQUEST" and caught.value.details == {"n_ctx": 1000, "n_seq_max": 4}
    with pytest.raises(ApplianceError) as faked:  # the fake engine's context refuses it as llama.cpp's would pad it
        FakeContext(FakeEngine(), n_ctx=1000, n_seq_max=4, split=True)
    assert faked.value.details == caught.value.details
    assert FakeContext(FakeEngine(), n_ctx=1024, n_seq_max=4, split=True).seq_cells == 256


def test_a_prefix_copied_between_streams_goes_on_like_the_prompt_run_whole(weights: ModelWeights) -> None:
    whole = weights.tokenize(PROMPTS[1] + " and the rest of it", bos=True)
    prefix = len(weights.tokenize(PROMPTS[1], bos=True))
    with flash_off(weights, n_ctx=768, n_seq_max=3, n_batch=N_BATCH, n_threads=THREADS, split=True) as context:
        context.add(0, whole[:prefix], GREEDY, 8)
        context.step()  # prefilled, generating: a live source is copied as it is
        context.copy(0, 2, prefix - 1)
        assert context.cells(2) == prefix - 1
        context.add(2, whole[prefix - 1:], GREEDY, 12, n_past=prefix - 1)
        runs: dict[int, Run] = {}
        finish(context, runs)
    assert_matches(runs[2], solo(weights, whole, 12))


def test_a_parked_state_moves_between_split_streams_and_one_pool(weights: ModelWeights) -> None:
    tokens = weights.tokenize(PROMPTS[2], bos=True)
    with flash_off(weights, n_ctx=512, n_seq_max=2, n_batch=N_BATCH, n_threads=THREADS, split=True) as split:
        split.add(1, tokens, GREEDY, 6)
        runs: dict[int, Run] = {}
        finish(split, runs)
        split.finish(1)
        cells = split.cells(1)
        state = split.state(1)
    with flash_off(weights, n_ctx=512, n_seq_max=2, n_batch=N_BATCH, n_threads=THREADS) as unified:
        unified.load_state(0, state, cells)
        unified.add(0, [runs[1].tokens[-1]], GREEDY, 10, n_past=cells)
        finish(unified, runs)
    whole = Run(runs[1].tokens + runs[0].tokens, runs[1].logits + runs[0].logits)
    assert_matches(whole, solo(weights, tokens, 16))


def test_a_split_step_puts_its_tokens_in_sequence_id_order(weights: ModelWeights) -> None:
    """llama.cpp makes a micro-batch of a split context from consecutive sequence ids only: the batch follows the
    ids, not the order the sequences joined in."""
    prompts = tokenize_all(weights, PROMPTS[:3])
    with flash_off(weights, n_ctx=1024, n_seq_max=4, n_batch=N_BATCH, n_threads=THREADS, split=True) as context:
        for seq_id, tokens in zip((3, 0, 2), prompts, strict=True):
            context.add(seq_id, tokens, GREEDY, 4)
        for _ in range(2):
            context.step()
            batch = context._batch
            ids = [batch.seq_id[index][0] for index in range(batch.n_tokens)]
            assert ids == sorted(ids) and set(ids) == {0, 2, 3}


# -- the choice (pure) ----------------------------------------------------------------------------------
SETTINGS = Settings(adaptive=True, window_size=8, sample_rate=1, hot_pool_slack=1.2, plan_boundaries=(128, 512),
                    thread_idle_thresholds=(60, 30), fixed_threads=2, pinned_threads=False, live_slots=8)
TURN = 129  # a 64-token prompt, its BOS and 64 tokens


def sample(need: int, live: int) -> RequestSample:
    return RequestSample(input_tokens=64, output_tokens=64, prompt_evaluated=64, ttft_s=0.01, decode_s=0.05,
                         kv_cells_used=need, kv_cells_peak=need * live, live_sequences=live, threads=2,
                         queue_length=0, kv_cells_need=need)


@pytest.mark.parametrize(("need", "live", "slots", "maximum", "current", "streams"), [
    (129, 4, 8, 16384, None, (256, 4)),  # 129 x 1.2 = 155 -> a 256-cell stream for each of the 4 seen together
    (129, 6, 4, 16384, None, (256, 4)),  # at most live_slots streams
    (129, 4, 8, 1000, None, None),  # 4 streams of 256 would pass the maximum: one pool
    (129, 1, 8, 16384, None, None),  # one at a time: nothing to split
    (129, 4, 1, 16384, None, None),  # one live slot
    (300, 2, 8, 16384, None, (512, 2)),  # 360 -> 512 a stream
    (150, 4, 8, 16384, (512, 4), (256, 4)),  # 180 -> 256, 50 % below the current 512: shrinks
    (800, 4, 8, 16384, (1280, 4), (1280, 4)),  # 960 -> 1024, 20 % below the current 1280: kept
    (900, 4, 8, 16384, (768, 4), (1280, 4)),  # 1080 -> 1280: grows at once
    (129, 3, 8, 16384, (256, 4), (256, 4)),  # one stream fewer: kept (streams shrink to half or less)
    (129, 2, 8, 16384, (256, 4), (256, 2)),  # half: fewer streams
    (129, 6, 8, 16384, (256, 4), (256, 6)),  # more at once
    (0, 4, 8, 16384, None, (256, 4)),  # the smallest stream: 256 cells
])
def test_split_streams(need: int, live: int, slots: int, maximum: int, current: tuple[int, int] | None,
                       streams: tuple[int, int] | None) -> None:
    assert tuning.split_streams(need, live, 1.2, slots, maximum=maximum, current=current) == streams


def test_split_streams_refuses_figures_out_of_range() -> None:
    for arguments, message in (((-1, 2, 1.2, 4), "need and live"), ((10, 2, 0.5, 4), "slack"),
                               ((10, 2, 1.2, 0), "live_slots")):
        with pytest.raises(ValueError, match=message):
            tuning.split_streams(*arguments, maximum=1024)


def test_concurrent_requests_get_split_streams_and_one_at_a_time_one_pool() -> None:
    together = Tuner(SETTINGS, 16384, 2)
    alone = Tuner(SETTINGS, 16384, 2)
    for _ in range(MIN_SAMPLES):
        together.observe(sample(TURN, 4))
        alone.observe(sample(TURN, 1))
    assert together.decide(0) == Tuning(1024, "S", 2, streams=4)
    assert alone.decide(0).split is False
    small = Tuner(SETTINGS, 768, 2)  # four 256-cell streams would pass the model's n_ctx
    for _ in range(MIN_SAMPLES):
        small.observe(sample(TURN, 4))
    assert small.decide(0).split is False
    told_nothing = Tuner(SETTINGS, 16384, 2)  # samples without their own claim (kv_cells_need 0)
    for _ in range(MIN_SAMPLES):
        told_nothing.observe(replace(sample(TURN, 4), kv_cells_need=0))
    assert told_nothing.decide(0).split is False
    prompt_heavy = Tuner(SETTINGS, 16384, 2)  # long prompts, short answers: split prompt steps cost more
    for _ in range(MIN_SAMPLES):
        prompt_heavy.observe(replace(sample(TURN, 4), prompt_evaluated=400, output_tokens=16))
    assert prompt_heavy.decide(0).split is False
    warmed = Tuner(SETTINGS, 16384, 2)  # warm-up runs (alone, prompt-heavy) do not count against the agents
    for _ in range(8):
        warmed.seed(replace(sample(TURN, 1), prompt_evaluated=96, output_tokens=8))
    for _ in range(MIN_SAMPLES):
        warmed.observe(sample(TURN, 4))
    assert warmed.decide(0).split is True
    cannot = Tuner(SETTINGS, 16384, 2)  # a model whose KV cache is not a plain one
    cannot.splits = False
    for _ in range(MIN_SAMPLES):
        cannot.observe(sample(TURN, 4))
    assert cannot.decide(0).split is False


def test_a_request_longer_than_a_stream_brings_one_pool_back_for_a_window() -> None:
    tuner = Tuner(SETTINGS, 16384, 2)
    for _ in range(MIN_SAMPLES):
        tuner.observe(sample(TURN, 4))
    tuner.applied(tuner.decide(0))
    assert tuner.current == Tuning(1024, "S", 2, streams=4)
    assert tuner.queue_demand(200) is False  # fits a 256-cell stream: nothing to do
    assert tuner.queue_demand(700) is True  # longer than a stream: one pool that holds it
    wanted = tuner.decide(0)
    assert wanted.split is False and wanted.pool_cells >= 700
    tuner.applied(wanted)
    for _ in range(SETTINGS.window_size - 1):
        tuner.observe(sample(TURN, 4))
        assert tuner.decide(0).split is False  # held while the window turns over
    tuner.observe(sample(TURN, 4))
    assert tuner.decide(0).split is True  # then the profile speaks again


def test_requests_waiting_for_a_stream_get_more_streams_at_once() -> None:
    """The profile counts the requests that ran together, never more than the streams: the requests waiting for
    one raise the count while the window turns over."""
    tuner = Tuner(SETTINGS, 16384, 2)
    for _ in range(MIN_SAMPLES):
        tuner.observe(sample(TURN, 2))
    tuner.applied(tuner.decide(0))
    assert tuner.current == Tuning(512, "S", 2, streams=2)
    assert tuner.stream_demand(2) is False  # as many as it has
    assert tuner.stream_demand(5) is True  # 2 in flight, 3 waiting
    assert tuner.decide(0) == Tuning(1280, "S", 2, streams=5)
    tuner.applied(tuner.decide(0))
    assert tuner.stream_demand(12) is True and tuner.decide(0).streams == 8  # at most live_slots
    assert tuner.stream_demand(12) is True  # not served yet: asked again (the daemon's one retune at a time)
    tuner.applied(tuner.decide(0))
    assert tuner.stream_demand(12) is False  # served: as many as live_slots
    for _ in range(SETTINGS.window_size):  # the floor goes with the window: the profile's 2 again
        tuner.observe(sample(TURN, 2))
    assert tuner.decide(0).streams == 2
    unified = Tuner(SETTINGS, 16384, 2)
    assert unified.stream_demand(5) is False  # one pool: its sequences are live_slots already


def test_a_demand_for_streams_that_built_nothing_is_asked_again() -> None:
    """A retune that served no stream demand (the ledger refused the larger context, or a queue floor stopped the
    switch) leaves the context as it was: the next request that finds every stream busy asks again (before, the
    floor the first demand set made it 'asked for already', and the waiting requests waited for whole generations
    until the window turned over)."""
    tuner = Tuner(SETTINGS, 16384, 2)
    for _ in range(MIN_SAMPLES):
        tuner.observe(sample(TURN, 4))
    tuner.applied(tuner.decide(0))
    assert tuner.current.streams == 4
    assert tuner.stream_demand(8) is True
    assert tuner.decide(0).streams == 8
    tuner.applied(tuner.current)  # the switch built nothing: still 4 streams
    for _ in range(3):
        tuner.observe(sample(TURN, 4))  # requests of the 4 streams end
        assert tuner.stream_demand(8) is True  # the 4 waiting ask again
        assert tuner.decide(0).streams == 8
    tuner.applied(tuner.decide(0))
    assert tuner.stream_demand(8) is False


@pytest.mark.parametrize(("samples", "lighter"), [
    ([(64, 64, 4)], True),  # as many generated as evaluated
    ([(65, 64, 4)], False),
    ([(400, 16, 4), (10, 500, 2)], True),  # summed over the requests that ran together
    ([(400, 16, 4), (500, 8, 1)], False),
    ([(10, 500, 1)], False),  # none ran beside another
    ([], False),
])
def test_prompts_lighter(samples: list[tuple[int, int, int]], lighter: bool) -> None:
    window = [replace(sample(TURN, live), prompt_evaluated=evaluated, output_tokens=generated)
              for evaluated, generated, live in samples]
    assert prompts_lighter(window) is lighter


def test_the_fixed_strategy_is_never_split() -> None:
    tuner = Tuner(replace(SETTINGS, adaptive=False), 16384, 2)
    for _ in range(MIN_SAMPLES):
        tuner.observe(sample(TURN, 4))
    assert tuner.decide(0).split is False
    for bad, message in (({"plan": "fixed"}, "one pool"), ({"pool_cells": 1002}, "divide pool_cells"),
                         ({"streams": -1}, "divide pool_cells")):
        with pytest.raises(ValueError, match=message):
            Tuning(**{"pool_cells": 1024, "plan": "S", "threads": 2, "streams": 4, **bad})
    assert (Tuning(1024, "S", 2, streams=4).seq_cells(), Tuning(1024, "S", 2, streams=4).sequences(8)) == (256, 4)
    assert (Tuning(1024, "S", 2).seq_cells(), Tuning(1024, "S", 2).sequences(8)) == (1024, 8)


# -- the slots over a split context (fake engine) -----------------------------------------------------------
def on_engine_thread(test: Callable[[FakeEngine, Path], None]) -> Callable[[Path], None]:
    """Run ``test`` on a fake engine's thread (a runtime refuses calls from any other)."""
    def run(tmp_path: Path) -> None:
        engine = FakeEngine()
        try:
            engine._worker.submit(functools.partial(test, engine, tmp_path)).result(timeout=60)
        finally:
            engine.close()
    run.__name__ = test.__name__
    run.__doc__ = test.__doc__
    return run


def fake_runtime(engine: FakeEngine, tmp_path: Path, pool: Tuning) -> FakeRuntime:
    return FakeRuntime(engine, tmp_path / "fake.gguf", n_ctx=4096, live_slots=4, tuning=pool)


@on_engine_thread
def test_a_request_longer_than_its_stream_is_not_hot_even_with_the_pool_free(engine: FakeEngine,
                                                                              tmp_path: Path) -> None:
    runtime = fake_runtime(engine, tmp_path, Tuning(1024, "S", 1, streams=4))
    assert (runtime.seq_cells, runtime.pool_cells, runtime.sequences) == (256, 1024, 4)
    request = runtime.begin(Conversation(), "x" * 200, 100)  # 200 tokens and a BOS, 100 more: 301 cells
    assert isinstance(request, ColdNeeded) and request.cells == 301
    first = runtime.begin(Conversation(), "x" * 100, 100)  # each fits its own stream, beside the others
    second = runtime.begin(Conversation(), "y" * 100, 100)
    assert first is not None and second is not None and not isinstance(first, ColdNeeded)
    assert runtime.context is not None and runtime.context.cells_claimed() == 2 * 201


@on_engine_thread
def test_moving_to_split_streams_parks_the_conversations_without_a_stream_there(engine: FakeEngine,
                                                                                tmp_path: Path) -> None:
    """Into 2 streams of 256 cells: the long conversation does not fit one, the one on sequence 2 has none."""
    runtime = fake_runtime(engine, tmp_path, Tuning(1024, "S", 1))
    short, long, third = Conversation(), Conversation(), Conversation()
    runtime.generate(short, "x" * 50, 10)
    runtime.generate(long, "y" * 300, 10)
    runtime.generate(third, "z" * 50, 10)
    assert (short.seq, long.seq, third.seq) == (0, 1, 2)
    runtime.prepare(Tuning(512, "S", 1, streams=2))
    parked = runtime.switch()
    assert parked == [long, third] and long.where == third.where == "host"
    assert runtime.slots.holds(short) and runtime.sequences == 2
    assert runtime.generate(short, " more", 4).generated_tokens == 4
    assert runtime.generate(third, " more", 4).generated_tokens == 4  # restored into the free stream


@on_engine_thread
def test_requests_in_flight_are_carried_into_streams_only_when_each_fits_one(engine: FakeEngine,
                                                                             tmp_path: Path) -> None:
    runtime = fake_runtime(engine, tmp_path, Tuning(1024, "S", 1))
    request = runtime.begin(Conversation(), "x" * 300, 10)
    assert request is not None and not isinstance(request, ColdNeeded)
    runtime.prepare(Tuning(1024, "S", 1, streams=4))
    assert not runtime.carries(Tuning(1024, "S", 1, streams=4))
    assert runtime.switch(carry=True) is None  # it would not fit its stream: it stays where it is
    assert runtime.rebuild(Tuning(1024, "S", 1, streams=4), carry=True) is None
    assert runtime.carries(Tuning(2048, "S", 1, streams=4))  # 512-cell streams hold it
    runtime.prepare(Tuning(2048, "S", 1, streams=4))
    assert runtime.switch(carry=True) == []
    while not request.done:
        runtime.step()
    assert request.generation is not None and request.generation.generated_tokens == 10


# -- the daemon ---------------------------------------------------------------------------------------------
AGENTS = [f"agent{number}" for number in range(4)]


async def turns_together(daemon: Daemon, together: int) -> Any:
    """The four :data:`AGENTS` registered, then :data:`MIN_SAMPLES` short turns of the first ``together`` at once
    (the profile's samples); the model, its retunes applied."""
    for agent in AGENTS:
        await daemon.register(agent, "m")
    model = daemon.models["m"]
    for turn in range(MIN_SAMPLES):  # each generates more tokens than its prompt has (split streams pay there)
        await asyncio.gather(*(daemon.decode(agent, 24, f"Hi {turn}") for agent in AGENTS[:together]))
        if model.retuning is not None:
            await model.retuning
    return model


def test_the_daemon_splits_the_pool_for_concurrent_agents_and_unifies_it_for_a_long_one(
        tmp_path: Path, wide_model: Path) -> None:
    async def scenario() -> None:
        config = daemon_config(tmp_path, wide_model, threads=2, live_slots=4)
        daemon = Daemon(config, FakeDevice(8 * 2**30), Engine(2))
        try:
            model = await turns_together(daemon, 4)
            runtime = model.runtime
            assert runtime is not None and runtime.tuning.split is True
            assert runtime.context is not None and runtime.context.split and runtime.seq_cells == 256
            assert daemon.snapshot()["contexts"][0]["kv_streams"] == runtime.tuning.streams >= 2
            pool = runtime.pool_cells
            assert daemon.ledger.reservations()[context_key("m")] == daemon.adaptive.context_bytes(model, pool)
            result = await daemon.decode("agent0", 8, long_prompt(300))  # longer than a stream
            assert result.generation.generated_tokens == 8
            assert daemon.snapshot()["engine"]["cold_requests"] == 0  # the pool became one pool that holds it
            assert model.runtime.tuning.split is False and model.runtime.seq_cells >= result.generation.prompt_tokens
            assert daemon.snapshot()["contexts"][0]["kv_streams"] == 0
            again = await asyncio.gather(*(daemon.decode(agent, 4, " and on") for agent in AGENTS))
            assert all(item.generation.generated_tokens == 4 for item in again)
        finally:
            await daemon.close()

    asyncio.run(scenario())


def test_agents_waiting_for_a_stream_get_more_streams(tmp_path: Path, wide_model: Path) -> None:
    async def scenario() -> None:
        config = daemon_config(tmp_path, wide_model, threads=2, live_slots=4)
        daemon = Daemon(config, FakeDevice(8 * 2**30), Engine(2))
        try:
            model = await turns_together(daemon, 2)  # two agents at a time: two streams
            assert model.runtime is not None and model.runtime.tuning.streams == 2
            results = await asyncio.gather(*(daemon.decode(agent, 8, f"Now all of {agent}") for agent in AGENTS))
            assert all(result.generation.generated_tokens == 8 for result in results)
            if model.retuning is not None:
                await model.retuning
            assert model.runtime.tuning.streams >= 3  # those that waited for a stream asked for theirs
            assert daemon.snapshot()["engine"]["cold_requests"] == 0
        finally:
            await daemon.close()

    asyncio.run(scenario())


# -- the state's stream count (pure) ------------------------------------------------------------------------
HEAD = b"\xd8\x3c\x14\xaf" + (5).to_bytes(4, "little")  # llama.cpp's state magic, the sequence id it was saved from


def state_of(*records: bytes) -> bytes:
    return HEAD + len(records).to_bytes(4, "little") + b"".join(records)


RECORD = (3).to_bytes(4, "little") + bytes(range(1, 40)) + b"\x00\x00\x00\x00"  # 3 cells; its data may end in zeros
EMPTY = bytes(4)


@pytest.mark.parametrize(("state", "n_stream", "expected"), [
    (state_of(RECORD), 4, state_of(RECORD, EMPTY, EMPTY, EMPTY)),
    (state_of(EMPTY, EMPTY, RECORD, EMPTY), 1, state_of(RECORD)),
    (state_of(EMPTY, RECORD), 3, state_of(RECORD, EMPTY, EMPTY)),
    (state_of(EMPTY, EMPTY), 1, state_of(EMPTY)),  # a sequence without cells
    (state_of(EMPTY), 3, state_of(EMPTY, EMPTY, EMPTY)),
])
def test_restream_moves_the_one_record_and_keeps_its_bytes(state: bytes, n_stream: int, expected: bytes) -> None:
    restreamed = kvstreams.restream(state, n_stream)
    assert bytes(restreamed) == expected
    assert kvstreams.stream_count(restreamed) == n_stream
    assert bytes(kvstreams.restream(restreamed, kvstreams.stream_count(state))) in (state, state_of(
        *([RECORD] if RECORD in state else [EMPTY]), *[EMPTY] * (kvstreams.stream_count(state) - 1)))


def test_restream_returns_a_state_of_that_count_as_it_is() -> None:
    state = bytearray(state_of(EMPTY, RECORD))
    assert kvstreams.restream(state, 2) is state


@pytest.mark.parametrize(("state", "message"), [
    (HEAD, "at least 12 bytes"),
    (state_of(RECORD, RECORD + b"\x01"), "more than one stream"),
    (HEAD + (9).to_bytes(4, "little") + EMPTY, "cannot hold 9 stream records"),
    (HEAD + (0).to_bytes(4, "little"), "cannot hold 0"),
])
def test_restream_refuses_what_is_not_one_sequence_state(state: bytes, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kvstreams.restream(state, 3)
