"""Hops between the event loop and the engine thread per request, counted on the real daemon core with the real
engine and a real tiny model: a 1-token request alone is one engine job and one loop wake-up, and a step wakes the
loop once for every stream that got a token in it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import yaml
from counting_loop import CountingLoop

from appliance.config.validate import parse_config
from appliance.daemon.core import Daemon
from appliance.daemon.devices import FakeDevice
from appliance.engine.interface import Sampling, Token
from appliance.engine.runtime import Engine
from appliance.engine.worker import DEFAULT_QUEUE
from appliance.server.pump import TokenPump

GREEDY = Sampling(temperature=0.0)


class CountingEngine(Engine):
    """The real engine, counting the jobs submitted to its thread."""

    def __init__(self, n_threads: int) -> None:
        super().__init__(n_threads)
        self.jobs = 0

    def submit(self, fn: Callable[[], Any], *, queue: Hashable = DEFAULT_QUEUE) -> asyncio.Future[Any]:
        self.jobs += 1
        return super().submit(fn, queue=queue)


def make_daemon(tmp_path: Path, model: Path) -> tuple[Daemon, CountingEngine]:
    text = {"data_dir": str(tmp_path / "state"), "device": "fake:8GiB", "model_dirs": [str(model.parent)],
            "resync_interval_s": 0, "engine": {"warmup_runs": 0, "adaptive": False, "live_slots": 4},
            "models": [{"name": "m", "path": str(model), "n_ctx": 1024}]}
    engine = CountingEngine(2)
    return Daemon(parse_config(yaml.safe_dump(text), base_dir=tmp_path), FakeDevice(8 * 2**30), engine), engine


def run(body: Callable[[CountingLoop], Any]) -> Any:
    loop = CountingLoop()
    try:
        return loop.run_until_complete(body(loop))
    finally:
        loop.close()


def test_a_one_token_request_alone_is_one_engine_job_and_one_wake_up(tmp_path: Path, tiny_model: Path) -> None:
    daemon, engine = make_daemon(tmp_path, tiny_model)

    async def scenario(loop: CountingLoop) -> list[tuple[int, int]]:
        try:
            await daemon.complete("m", 1, "Hello world")  # loads the model: its own jobs
            await daemon.register("a", "m")
            await daemon.decode("a", 1, "Hello", GREEDY)
            hops = []
            for n in range(4):
                jobs, wakes = engine.jobs, loop.wakeups
                result = await daemon.complete("m", 1, f"Hello world {n}", GREEDY)
                assert result.generation.generated_tokens == 1
                hops.append((engine.jobs - jobs, loop.wakeups - wakes))
            for n in range(4):
                jobs, wakes = engine.jobs, loop.wakeups
                result = await daemon.decode("a", 1, f" and {n}", GREEDY)
                assert result.generation.generated_tokens == 1
                hops.append((engine.jobs - jobs, loop.wakeups - wakes))
            return hops
        finally:
            await daemon.close()

    hops = run(scenario)
    stateless, agent = hops[:4], hops[4:]
    assert all(jobs == 1 and wakes == 1 for jobs, wakes in stateless), stateless
    # An agent's decode also commits it to the store before its reply: the store's thread wakes the loop once more.
    assert all(jobs == 1 and wakes <= 2 for jobs, wakes in agent), agent


def test_a_step_wakes_the_loop_once_for_all_its_streams(tmp_path: Path, tiny_model: Path) -> None:
    daemon, engine = make_daemon(tmp_path, tiny_model)
    prompts = ["Once upon a time", "The quick brown fox", "Hello world"]

    async def scenario(loop: CountingLoop) -> tuple[int, int, list[str], list[str]]:
        try:
            alone = [(await daemon.complete("m", 12, prompt, GREEDY)).generation.text for prompt in prompts]
            streamed: list[list[str]] = [[] for _ in prompts]
            runtime = daemon.models["m"].runtime
            step = runtime.step

            def counted_step(*args: Any, **kwargs: Any) -> Any:
                nonlocal steps
                steps += 1
                return step(*args, **kwargs)

            steps = 0
            runtime.step = counted_step  # the real step, counted

            def sink_of(index: int) -> Callable[[list[Token]], bool]:
                def sink(tokens: list[Token]) -> bool:
                    streamed[index].append("".join(token.text for token in tokens))
                    return True
                return sink

            async def stream(index: int) -> None:
                pump = TokenPump(loop, sink_of(index), cancel=threading.Event())
                with pump:
                    await daemon.complete("m", 12, prompts[index], GREEDY, pump.on_token)

            jobs, wakes = engine.jobs, loop.wakeups
            await asyncio.gather(*(stream(index) for index in range(len(prompts))))
            return engine.jobs - jobs, loop.wakeups - wakes, steps, alone, streamed
        finally:
            await daemon.close()

    jobs, wakes, steps, alone, streamed = run(scenario)
    assert ["".join(parts) for parts in streamed] == alone  # every token arrived, in order, as made alone
    # 36 tokens (and 3 ends) in ~12 batched steps: one wake-up per step at most (and one per job's end), not one per
    # token; a step job goes on stepping while no other job waits, so there are fewer jobs than steps.
    assert wakes <= steps + jobs and wakes < 3 * 12, (wakes, steps, jobs)
    assert jobs < steps, (jobs, steps)
    # A job of several steps hands each step's tokens over as the step ends, not all at the job's end.
    assert all(len(parts) > 1 for parts in streamed), streamed


class StampingLoop(CountingLoop):
    """A counting loop that also numbers its iterations and stamps each hand-over from another thread with the
    iteration that runs it."""

    def __init__(self) -> None:
        super().__init__()
        self.iterations = 0
        self.handovers: list[int] = []

    def _run_once(self) -> None:
        self.iterations += 1
        super()._run_once()  # type: ignore[misc]

    def call_soon_threadsafe(self, callback: Callable[..., object], *args: Any,
                             context: Any = None) -> asyncio.Handle:
        def stamped(*given: Any) -> None:
            self.handovers.append(self.iterations)
            callback(*given)
        return super().call_soon_threadsafe(stamped, *args, context=context)


def test_a_stateless_reply_is_made_in_the_loop_iteration_that_learns_of_its_end(tmp_path: Path,
                                                                                 tiny_model: Path) -> None:
    """The engine job's wake-up first tells the request it ended; ``on_result`` (where MAGN writes its
    TASK_COMPLETE) runs right there, not after the job's result has gone through futures to the caller's task
    (two more loop iterations and the rest of the request's code); the request's counters still count it."""
    daemon, _ = make_daemon(tmp_path, tiny_model)
    loop = StampingLoop()

    async def scenario() -> list[tuple[int, int, str]]:
        try:
            await daemon.complete("m", 1, "Hello world", GREEDY)  # loads the model, reads its memory once
            seen = []
            answered: list[tuple[int, str]] = []

            def on_result(result: Any) -> None:
                answered.append((loop.iterations, result.generation.text))

            for n in range(4):
                answered.clear()
                handovers = len(loop.handovers)
                result = await daemon.complete("m", 1, f"Hello world {n}", GREEDY, on_result=on_result)
                assert len(loop.handovers) == handovers + 1  # one wake-up for the whole request
                assert len(answered) == 1 and answered[0][1] == result.generation.text
                seen.append((loop.handovers[-1], answered[0][0], result.generation.text))
            return seen
        finally:
            await daemon.close()

    try:
        decodes_before = 1
        seen = loop.run_until_complete(scenario())
    finally:
        loop.close()
    assert all(woke == answered for woke, answered, _ in seen), seen
    assert daemon.counters["decodes"] == decodes_before + 4
    assert daemon.counters["tokens"] == decodes_before + 4
