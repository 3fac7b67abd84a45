"""The burst gather (appliance.daemon.burst, appliance.engine.pace): a request starting alone on an idle live
context waits a share of its prompt's expected evaluation before its first step, so that a request arriving
meanwhile is evaluated in the same step. The policy and the pace are pure; the gather itself runs on the real
daemon core with the real engine and a real tiny model, the pace set by the test (a tiny model's prompts are too
quick to gather for on their own)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

from appliance.config.validate import parse_config
from appliance.daemon import burst
from appliance.daemon.core import Daemon
from appliance.daemon.devices import FakeDevice
from appliance.engine.interface import Sampling
from appliance.engine.pace import PROMPT_BATCH, Pace
from appliance.engine.runtime import Engine

GREEDY = Sampling(temperature=0.0)


def test_no_wait_before_the_pace_is_measured() -> None:
    assert burst.gather_window(None) == 0.0


def test_the_wait_is_a_share_of_the_expected_evaluation_capped() -> None:
    assert burst.gather_window(0.100) == pytest.approx(burst.GATHER_SHARE * 0.100)
    assert burst.gather_window(60.0) == burst.GATHER_MAX_S


def test_a_prompt_too_quick_to_gather_for_does_not_wait() -> None:
    quick = 0.9 * burst.GATHER_MIN_S / burst.GATHER_SHARE
    assert burst.gather_window(quick) == 0.0
    assert burst.gather_window(1.1 * burst.GATHER_MIN_S / burst.GATHER_SHARE) > 0.0


def test_a_request_that_joins_extends_the_window_within_the_span() -> None:
    expected = 0.200
    window = burst.gather_window(expected)
    span = burst.gather_span(expected)
    assert window < span == min(burst.GATHER_SPAN_MAX_S, burst.GATHER_SPAN_SHARE * expected)
    opened = 100.0
    until = opened + window
    limit = opened + span
    assert burst.extended(until, limit, opened + 0.002, window) == pytest.approx(opened + 0.002 + window)
    assert burst.extended(until, limit, opened - 0.005, window) == until  # never earlier than it was
    later = burst.extended(until, limit, until - 0.001, window)
    assert later == pytest.approx(until - 0.001 + window)
    assert burst.extended(later, limit, limit - 0.001, window) == limit  # never past the span
    assert burst.gather_span(None) == 0.0
    assert burst.gather_span(0.9 * burst.GATHER_MIN_S / burst.GATHER_SHARE) == 0.0  # too quick: no window at all


def test_the_first_step_waits_for_the_window_then_for_requests_on_their_way_up_to_a_cap() -> None:
    opened, until = 100.0, 100.010
    last = opened + burst.GATHER_PENDING_MAX_S
    assert burst.gather_wait(100.004, until, opened, pending=0) == pytest.approx(0.006)
    assert burst.gather_wait(100.004, until, opened, pending=3) == pytest.approx(0.006)
    assert burst.gather_wait(100.020, until, opened, pending=0) == 0.0  # the window is over, nothing on its way
    assert burst.gather_wait(100.020, until, opened, pending=2) == burst.GATHER_POLL_S
    assert burst.gather_wait(last - 0.0005, until, opened, pending=2) == pytest.approx(0.0005)
    assert burst.gather_wait(last, until, opened, pending=2) == 0.0  # the cap: go with what came


def test_the_pace_ignores_decode_steps_and_follows_prompt_steps() -> None:
    pace = Pace()
    assert pace.seconds(64) is None
    pace.observe(0.020, 8)  # a decode step: the weights' read, not its tokens
    assert pace.seconds(64) is None
    pace.observe(0.064, 64)
    assert pace.seconds(64) == pytest.approx(0.064)
    pace.observe(0.640, PROMPT_BATCH * 10)  # 2 ms per token: the figure moves towards it, not onto it
    assert 0.064 < pace.seconds(64) < 0.128
    pace.observe(0.0, 64)  # a clock that did not move says nothing
    assert 0.064 < pace.seconds(64) < 0.128


class RecordingPace(Pace):
    """A pace fixed by the test, recording the size of every timed step's batch."""

    def __init__(self, seconds_per_token: float | None) -> None:
        super().__init__()
        self.seconds_per_token = seconds_per_token
        self.batches: list[int] = []

    def observe(self, seconds: float, tokens: int) -> None:
        self.batches.append(tokens)


def make_daemon(tmp_path: Path, model: Path) -> Daemon:
    text = {"data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "model_dirs": [str(model.parent)],
            "resync_interval_s": 0, "engine": {"warmup_runs": 0, "adaptive": False, "live_slots": 4},
            "models": [{"name": "m", "path": str(model), "n_ctx": 1024}]}
    return Daemon(parse_config(yaml.safe_dump(text), base_dir=tmp_path), FakeDevice(8 * 2**30), Engine(2))


PROMPTS = ("Once upon a time there was a fox", "The quick brown fox jumps over the lazy dog")


@dataclass
class Pair:
    """Two requests sent one after the other: the first step's batch, their prompt tokens, the texts they got and
    their texts alone, and the ``burst_tokens`` each reported together and alone."""

    batch: int
    sizes: list[int]
    together: list[str]
    alone: list[str]
    bursts: list[int]
    bursts_alone: list[int]


def first_batch_of_two(tmp_path: Path, model: Path, seconds_per_token: float | None,
                       monkeypatch: pytest.MonkeyPatch) -> Pair:
    """Two requests, the second started once the first has started (:class:`Pair`)."""
    monkeypatch.setattr(burst, "GATHER_MAX_S", 2.0)  # a loaded box's hops never outlast the window
    daemon = make_daemon(tmp_path, model)

    async def scenario() -> Pair:
        try:
            solo = [await daemon.complete("m", 6, prompt, GREEDY) for prompt in PROMPTS]
            model_state = daemon.models["m"]
            runtime = model_state.runtime
            pace = RecordingPace(seconds_per_token)
            runtime.slots.pace = pace
            sizes = [await daemon.count("m", prompt) for prompt in PROMPTS]
            first = asyncio.ensure_future(daemon.complete("m", 6, PROMPTS[0], GREEDY))
            while model_state.decoding == 0:  # the first has started on the engine thread
                await asyncio.sleep(0.0005)
            second = asyncio.ensure_future(daemon.complete("m", 6, PROMPTS[1], GREEDY))
            results = await asyncio.gather(first, second)
            return Pair(pace.batches[0], sizes, [result.generation.text for result in results],
                        [result.generation.text for result in solo], [result.burst_tokens for result in results],
                        [result.burst_tokens for result in solo])
        finally:
            await daemon.close()

    return asyncio.run(scenario())


def test_a_request_arriving_in_the_window_joins_the_first_step(tmp_path: Path, tiny_model: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    pair = first_batch_of_two(tmp_path, tiny_model, 1.0, monkeypatch)
    assert pair.batch == sum(pair.sizes)  # both prompts in one step
    assert pair.together == pair.alone
    assert pair.bursts == [sum(pair.sizes)] * 2  # each knows the step that ended both prompts (the plan's figure)
    assert pair.bursts_alone == [0, 0]


def test_without_a_measured_pace_the_first_request_steps_alone(tmp_path: Path, tiny_model: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    pair = first_batch_of_two(tmp_path, tiny_model, None, monkeypatch)
    assert pair.batch == pair.sizes[0]  # its first step came in its start's engine job, before the second arrived
    assert pair.together == pair.alone
    assert pair.bursts == [0, 0]  # each prompt ended in a step of its own: no burst


def test_starts_that_each_outlast_the_window_all_join_the_first_step(tmp_path: Path, tiny_model: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Four requests sent together whose starts each take longer than the window (as a start that parks an idle
    conversation does): each extends it, so the first step evaluates the four prompts; before, the step was queued
    while some starts still waited and ran between them."""
    monkeypatch.setattr(burst, "GATHER_MAX_S", 0.020)
    monkeypatch.setattr(burst, "GATHER_SPAN_MAX_S", 2.0)
    daemon = make_daemon(tmp_path, tiny_model)
    prompts = [*PROMPTS, "Rain fell on the quiet town all night", "Seven sailors rowed towards the far island"]

    async def scenario() -> tuple[int, list[int], list[str], list[str]]:
        try:
            alone = [(await daemon.complete("m", 6, prompt, GREEDY)).generation.text for prompt in prompts]
            runtime = daemon.models["m"].runtime
            pace = RecordingPace(1.0)
            runtime.slots.pace = pace
            real_begin = runtime.begin

            def slow_begin(*args, **kwargs):  # type: ignore[no-untyped-def]
                time.sleep(0.030)  # on the engine thread: a park's copy
                return real_begin(*args, **kwargs)

            runtime.begin = slow_begin
            sizes = [await daemon.count("m", prompt) for prompt in prompts]
            results = await asyncio.gather(*(daemon.complete("m", 6, prompt, GREEDY) for prompt in prompts))
            return pace.batches[0], sizes, [result.generation.text for result in results], alone
        finally:
            await daemon.close()

    batch, sizes, together, alone = asyncio.run(scenario())
    assert batch == sum(sizes)  # the four prompts in one step
    assert together == alone


def test_a_request_whose_agent_is_still_being_registered_joins_the_first_step(tmp_path: Path, tiny_model: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """A stateless request opens a burst while another client's new agent is being registered (its store commit
    takes longer than the window): the first step waits for that agent's first request and evaluates both prompts;
    before, it went once the window was over, and the agent's prompt waited for the whole step."""
    daemon = make_daemon(tmp_path, tiny_model)
    real_commit = daemon.commit_agent

    async def slow_commit(agent):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.060)  # a registration's store commit on a busy box, longer than the window
        return await real_commit(agent)

    async def registered_then_decoded(prompt: str):  # type: ignore[no-untyped-def]
        await daemon.register("late", "m")
        return await daemon.decode("late", 6, prompt, GREEDY)

    async def scenario() -> tuple[int, list[int], list[str], list[str]]:
        try:
            alone = [(await daemon.complete("m", 6, prompt, GREEDY)).generation.text for prompt in PROMPTS]
            model_state = daemon.models["m"]
            pace = RecordingPace(1.0)
            model_state.runtime.slots.pace = pace
            sizes = [await daemon.count("m", prompt) for prompt in PROMPTS]
            monkeypatch.setattr(daemon, "commit_agent", slow_commit)
            late = asyncio.ensure_future(registered_then_decoded(PROMPTS[1]))
            while model_state.registering == 0:
                await asyncio.sleep(0.0005)
            first = await daemon.complete("m", 6, PROMPTS[0], GREEDY)
            second = await late
            return pace.batches[0], sizes, [first.generation.text, second.generation.text], alone
        finally:
            await daemon.close()

    batch, sizes, together, alone = asyncio.run(scenario())
    assert batch == sum(sizes)  # both prompts in one step
    assert together == alone
