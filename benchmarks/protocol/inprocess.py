"""The in-process paths: llama-cpp-python called directly (the baseline, with and without ``reset``), the
appliance's engine (``Runtime``) and its daemon core (``Daemon.complete``), all on one llama.cpp thread
(:class:`ComputeThread`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import llama_cpp

from appliance.config.validate import parse_config
from appliance.daemon.core import Daemon
from appliance.daemon.devices import open_device
from appliance.engine.runtime import Conversation, Engine, Runtime, Sampling, Token
from benchmarks.protocol.workload import MODEL_NAME, Contender, Sample


class ComputeThread:
    """The benchmark process's one llama.cpp thread (an appliance :class:`Engine` worker, as in the daemon).

    llama.cpp here is built with OpenMP, whose thread team belongs to the thread that calls it: once a second
    thread of a process has run llama.cpp work (and while it lives), every decode in that process slows down
    about 3x on a 2-core box (the teams oversubscribe the cores and libgomp stops spinning at its barriers).
    So every in-process path loads and runs its model on this one thread, timed inside it (the hop is not
    counted, except for ``Daemon.complete``, whose hop is part of what it measures).
    """

    def __init__(self, threads: int) -> None:
        self.engine = Engine(threads)
        self.runner = asyncio.Runner()

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.runner.run(self.engine.call(fn, *args))

    def close(self) -> None:
        self.engine.close()
        self.runner.close()


class Library(Contender):
    """llama-cpp-python called directly; ``reset`` makes every call evaluate its whole prompt."""

    kind = "in-process"

    def __init__(self, compute: ComputeThread, llm: llama_cpp.Llama, *, reset: bool) -> None:
        self.compute, self.llm, self.reset = compute, llm, reset
        self.name = "library" if reset else "library_prefix"
        self.label = ("llama-cpp-python Llama.create_completion" if reset
                      else "llama-cpp-python, prefix cache (as llama_cpp.server calls it)")

    def _one(self, prompt: str) -> Sample:
        if self.reset:
            self.llm.reset()
        start = time.perf_counter()
        r = self.llm.create_completion(prompt, max_tokens=1, temperature=0.0)
        elapsed = time.perf_counter() - start
        return Sample(elapsed, r["choices"][0]["text"], r["usage"]["completion_tokens"])

    def _stream(self, prompt: str, n: int) -> Sample:
        if self.reset:
            self.llm.reset()
        parts: list[str] = []
        ttft = None
        start = time.perf_counter()
        for chunk in self.llm.create_completion(prompt, max_tokens=n, temperature=0.0, stream=True):
            choice = chunk["choices"][0]
            if choice["finish_reason"] is not None and not choice["text"]:
                continue  # the closing chunk that only carries finish_reason
            if ttft is None:
                ttft = time.perf_counter() - start
            parts.append(choice["text"])
        elapsed = time.perf_counter() - start
        return Sample(elapsed, "".join(parts), len(parts), ttft)

    def one(self, prompt: str) -> Sample:
        return self.compute.call(self._one, prompt)

    def stream(self, prompt: str, n: int) -> Sample:
        return self.compute.call(self._stream, prompt, n)

    def close(self) -> None:
        self.compute.call(self.llm.close)


class EngineDirect(Contender):
    """The appliance's engine, called directly: what a stateless request runs on the engine thread."""

    name, label, kind = "engine", "appliance engine Runtime (in-process)", "in-process"

    def __init__(self, compute: ComputeThread, rt: Runtime) -> None:
        self.compute, self.rt = compute, rt
        self.sampling = Sampling(temperature=0.0, top_p=0.95)  # what a MAGN request's defaults become

    def _run(self, prompt: str, n: int, stream: bool) -> Sample:
        first: list[float] = []

        def on_token(token: Token) -> None:
            if not first:
                first.append(time.perf_counter())

        start = time.perf_counter()
        conv = Conversation()
        try:
            gen = self.rt.generate(conv, prompt, n, self.sampling, on_token if stream else None)
        finally:
            self.rt.detach(conv)
        elapsed = time.perf_counter() - start
        return Sample(elapsed, gen.text, gen.generated_tokens, first[0] - start if first else None)

    def one(self, prompt: str) -> Sample:
        return self.compute.call(self._run, prompt, 1, False)

    def stream(self, prompt: str, n: int) -> Sample:
        return self.compute.call(self._run, prompt, n, True)

    def close(self) -> None:
        self.compute.call(self.rt.close)


class DaemonCore(Contender):
    """``Daemon.complete`` in an event loop, on the same engine thread: the hop and bookkeeping, no socket."""

    name, label, kind = "daemon", "appliance Daemon.complete (in-process, no socket)", "in-process"

    def __init__(self, compute: ComputeThread, config_text: str, base_dir: Path) -> None:
        config = parse_config(config_text, source=base_dir / "appliance.yaml", base_dir=base_dir)
        self.compute = compute
        self.daemon = Daemon(config, open_device(config.device), engine=compute.engine)
        self.sampling = Sampling(temperature=0.0, top_p=0.95)

    async def _timed(self, prompt: str, n: int, stream: bool) -> Sample:
        loop = asyncio.get_running_loop()
        first: list[float] = []

        def mark() -> None:
            if not first:
                first.append(time.perf_counter())

        def on_token(token: Token) -> None:  # on the engine thread, like the MAGN session's callback
            loop.call_soon_threadsafe(mark)

        start = time.perf_counter()
        result = await self.daemon.complete(MODEL_NAME, n, prompt, self.sampling, on_token if stream else None)
        elapsed = time.perf_counter() - start
        gen = result.generation
        return Sample(elapsed, gen.text, gen.generated_tokens, first[0] - start if first else None)

    def one(self, prompt: str) -> Sample:
        return self.compute.runner.run(self._timed(prompt, 1, False))

    def stream(self, prompt: str, n: int) -> Sample:
        return self.compute.runner.run(self._timed(prompt, n, True))

    def close(self) -> None:
        for model in list(self.daemon.models.values()):  # Daemon.close would also close the shared engine
            self.compute.runner.run(self.daemon.unload(model))

