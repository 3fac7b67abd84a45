"""Protocol overhead: a direct library call vs the appliance over MAGN frames vs HTTP (SPEC B4, P1–P5).

One run, one tiny model (4 layers, 256 wide, f16), the same greedy requests (temperature 0) on every path:

* **in-process**: llama-cpp-python called directly (``Llama.create_completion``; the baseline), and the
  appliance's own engine (``Runtime.attach`` / ``generate`` / ``detach`` of a fresh ``Conversation``, what a
  stateless request runs on the engine thread) and daemon core (``Daemon.complete`` in an event loop: the
  engine-thread hop and bookkeeping, no socket);
* **MAGN**: the appliance as ``python -m appliance run`` (its own process, like a real daemon), over its Unix
  socket, one persistent connection per client: the shipped blocking ``MagnClient``, ``AsyncMagnClient`` in one
  event loop, and a minimal blocking socket client built on the same codec (the floor for any client);
* **HTTP**: the appliance's own OpenAI endpoint when it has one (``/v1/completions``; probed, and the output
  says when it is missing), and llama-cpp-python's bundled ``llama_cpp.server`` (its own process, uvicorn),
  over one keep-alive ``httpx`` connection. When ``llama_cpp.server`` cannot be imported (its extras are not
  installed) or ``--no-http`` is given, the output says that it was skipped and why.

Every request is the same on every path: prompt -> 1 token, and prompt -> 64-token stream. Two prompts of equal
token length (different first word) alternate request by request, on every path alike: with one fixed prompt,
llama-cpp-python (and so ``llama_cpp.server``) answers a repeated 1-token request from its prefix cache without
decoding anything, which would compare a decode with no decode. The in-process library baseline calls
``Llama.reset()`` first, so it evaluates the whole prompt, like the appliance's stateless request;
``library_prefix`` (no reset, what ``llama_cpp.server`` does inside) only reuses the BOS cell.

Measurement is interleaved after a warm-up: each round visits the paths in a fresh random order, each path's turn
being a short pause (see :func:`rounds`) and a block of back-to-back requests, so a noisy machine hurts every path
alike; figures are medians. Overhead = median(path) - median(in-process library call). Correctness: every path's
greedy text must equal the library's for the same prompt (1 token and 64 tokens); the run exits 1 otherwise.

Run ``python -m benchmarks.protocol`` (``--quick`` for a seconds-long smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import itertools
import json
import os
import platform
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp
import yaml

from appliance import messages as m
from appliance.client import AsyncMagnClient, MagnClient
from appliance.config import parse_config
from appliance.daemon import Daemon
from appliance.devices import open_device
from appliance.engine import Conversation, Engine, Runtime, Sampling, Token
from appliance.frames import CLOSED, NEED_DATA, FrameParser
from appliance.tinymodel import write_tiny_model

NAME = "protocol"
RESULTS_DIR = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_DIR = Path(tempfile.gettempdir()) / "appliance-bench-models"
MODEL_NAME = "bench"
PROMPTS = ("Once upon a time", "Hello world, this is a test")  # 8 tokens each (BOS included), tiny vocabulary
TARGET_OVERHEAD_MS = 0.3
TARGET_STREAM_RATIO = 0.97
START_TIMEOUT_S = 120.0
SETTLE_S = 0.02  # pause before each path's turn (see rounds)
BLOCK = 10  # 1-token requests per path per round, back to back


@dataclass(frozen=True)
class Sample:
    elapsed_s: float
    text: str
    tokens: int
    ttft_s: float | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def model_path(model_dir: Path, layers: int, dim: int, seed: int = 0) -> Path:
    path = model_dir / f"tiny-{layers}x{dim}-f16-s{seed}.gguf"
    if not path.is_file():
        write_tiny_model(path, layers=layers, dim=dim, seed=seed, dtype="f16")
    return path


def magn_request(prompt: str, max_tokens: int) -> dict[str, Any]:
    """The INFER_REQUEST fields every MAGN path sends (stateless: a model, no session)."""
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}


def http_request(prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    # llama_cpp.server defaults repeat_penalty to 1.1 (the library to 1.0): ask for the library's greedy request.
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "repeat_penalty": 1.0,
            "stream": stream}


# -- paths -----------------------------------------------------------------------------------------------------

class Contender:
    """One way of running the request: ``one`` (max_tokens=1) and ``stream`` (n tokens, token by token)."""

    name = ""
    label = ""
    kind = ""  # in-process | magn | http

    def one(self, prompt: str) -> Sample:
        raise NotImplementedError

    def stream(self, prompt: str, n: int) -> Sample:
        raise NotImplementedError

    def close(self) -> None:
        pass


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
        self.rt.attach(conv)
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


class MagnRaw(Contender):
    """A minimal blocking client on the appliance's own codec: encode a frame, ``sendall``, parse replies."""

    name, label, kind = "magn_raw", "MAGN, minimal blocking socket client", "magn"

    def __init__(self, path: Path) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(str(path))
        self.parser = FrameParser()
        self.ids = itertools.count(1)

    def _run(self, prompt: str, n: int, stream: bool) -> Sample:
        start = time.perf_counter()
        task_id = f"r{next(self.ids)}"
        self.sock.sendall(m.encode_message(m.InferRequest(task_id, **magn_request(prompt, n), stream=stream)))
        ttft = None
        while True:
            event = self.parser.next_event()
            if event is NEED_DATA:
                self.parser.receive_data(self.sock.recv(1 << 16))
                continue
            if event is CLOSED:
                raise ConnectionError("the appliance closed the connection")
            msg = m.parse_message(event.payload)
            if isinstance(msg, m.StreamToken) and ttft is None:
                ttft = time.perf_counter() - start
            elif isinstance(msg, m.TaskComplete):
                elapsed = time.perf_counter() - start
                return Sample(elapsed, msg.text, msg.usage.completion_tokens, ttft)
            elif isinstance(msg, m.ErrorMessage):
                raise msg.error.exception()

    def one(self, prompt: str) -> Sample:
        return self._run(prompt, 1, False)

    def stream(self, prompt: str, n: int) -> Sample:
        return self._run(prompt, n, True)

    def close(self) -> None:
        self.sock.close()


class MagnAsync(Contender):
    """``AsyncMagnClient`` on one connection, driven in one event loop; timed inside the loop."""

    name, label, kind = "magn_async", "MAGN, AsyncMagnClient (one event loop)", "magn"

    def __init__(self, path: Path) -> None:
        self.runner = asyncio.Runner()
        self.client = self.runner.run(AsyncMagnClient(str(path)).connect())

    async def _one(self, prompt: str) -> Sample:
        start = time.perf_counter()
        done = await self.client.infer(**magn_request(prompt, 1))
        elapsed = time.perf_counter() - start
        return Sample(elapsed, done.text, done.usage.completion_tokens)

    async def _stream(self, prompt: str, n: int) -> Sample:
        ttft = None
        start = time.perf_counter()
        tokens = self.client.stream(**magn_request(prompt, n))
        async for _ in tokens:
            if ttft is None:
                ttft = time.perf_counter() - start
        elapsed = time.perf_counter() - start
        assert tokens.completion is not None
        return Sample(elapsed, tokens.completion.text, tokens.completion.usage.completion_tokens, ttft)

    def one(self, prompt: str) -> Sample:
        return self.runner.run(self._one(prompt))

    def stream(self, prompt: str, n: int) -> Sample:
        return self.runner.run(self._stream(prompt, n))

    def close(self) -> None:
        try:
            self.runner.run(self.client.close())
        finally:
            self.runner.close()


class MagnBlocking(Contender):
    """The shipped blocking ``MagnClient``, one instance (one connection) reused for every request."""

    name, label, kind = "magn", "MAGN, MagnClient (blocking)", "magn"

    def __init__(self, path: Path) -> None:
        self.client = MagnClient(str(path), timeout=60)

    def one(self, prompt: str) -> Sample:
        start = time.perf_counter()
        done = self.client.infer(**magn_request(prompt, 1))
        elapsed = time.perf_counter() - start
        return Sample(elapsed, done.text, done.usage.completion_tokens)

    def stream(self, prompt: str, n: int) -> Sample:
        ttft = None
        start = time.perf_counter()
        tokens = self.client.stream(**magn_request(prompt, n))
        for _ in tokens:
            if ttft is None:
                ttft = time.perf_counter() - start
        elapsed = time.perf_counter() - start
        assert tokens.completion is not None
        return Sample(elapsed, tokens.completion.text, tokens.completion.usage.completion_tokens, ttft)

    def close(self) -> None:
        self.client.close()


class Http(Contender):
    """An OpenAI-style ``/v1/completions`` over one keep-alive ``httpx`` connection (SSE when streaming)."""

    kind = "http"

    def __init__(self, name: str, label: str, base_url: str, extra: dict[str, Any] | None = None) -> None:
        import httpx

        self.name, self.label, self.extra = name, label, extra or {}
        self.http = httpx.Client(base_url=base_url, timeout=60)

    def one(self, prompt: str) -> Sample:
        start = time.perf_counter()
        r = self.http.post("/v1/completions", json={**http_request(prompt, 1, False), **self.extra})
        r.raise_for_status()
        doc = r.json()
        elapsed = time.perf_counter() - start
        return Sample(elapsed, doc["choices"][0]["text"], doc["usage"]["completion_tokens"])

    def stream(self, prompt: str, n: int) -> Sample:
        parts: list[str] = []
        ttft = None
        start = time.perf_counter()
        with self.http.stream("POST", "/v1/completions", json={**http_request(prompt, n, True), **self.extra}) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                choice = (json.loads(data).get("choices") or [{}])[0]
                if choice.get("finish_reason") is not None and not choice.get("text"):
                    continue  # the closing chunk that only carries finish_reason
                if ttft is None:
                    ttft = time.perf_counter() - start
                parts.append(choice.get("text") or "")
        elapsed = time.perf_counter() - start
        return Sample(elapsed, "".join(parts), len(parts), ttft)

    def close(self) -> None:
        self.http.close()


# -- servers in their own processes -------------------------------------------------------------------------------

class Process:
    """A server subprocess with its output in a log file; stopped with SIGTERM (then SIGKILL)."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)

    def tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-n:]
        return ""

    def wait_until(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(Exception):
                if ready():
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{what} did not become ready in {START_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


def appliance_config(model: Path, state: Path, *, n_ctx: int, threads: int, http_port: int) -> str:
    return yaml.safe_dump({
        "data_dir": str(state), "device": "host", "model_dirs": [str(model.parent)],
        "socket": {"path": str(state / "a.sock")}, "http": {"host": "127.0.0.1", "port": http_port},
        "resync_interval_s": 0, "log_level": "warning", "engine": {"threads": threads},
        "models": [{"name": MODEL_NAME, "path": str(model), "n_ctx": n_ctx, "idle_ttl_s": 0}],
    }, sort_keys=False)


def llama_server_missing() -> str | None:
    """Why ``llama_cpp.server`` cannot run here, or None when it can."""
    try:
        importlib.import_module("llama_cpp.server.app")
    except ImportError as exc:
        return (f"llama_cpp.server is not importable ({exc}); install its extras: "
                f"pip install 'llama-cpp-python[server]=={llama_cpp.__version__}'")
    return None


def start_llama_server(model: Path, port: int, params: llama_cpp.llama_context_params, n_ctx: int, n_batch: int,
                       log: Path) -> Process:
    import httpx

    proc = Process([sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
                    "--port", str(port), "--n_ctx", str(n_ctx), "--n_batch", str(n_batch),
                    "--n_threads", str(params.n_threads), "--n_threads_batch", str(params.n_threads_batch),
                    "--n_gpu_layers", "0", "--seed", "0", "--verbose", "False"], log)
    try:
        proc.wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200,
                        "llama_cpp.server")
    except BaseException:
        proc.stop()
        raise
    return proc


def probe_appliance_http(base_url: str) -> str | None:
    """None when the appliance answers ``POST /v1/completions``, else why not (what it said instead)."""
    import httpx

    try:
        r = httpx.post(base_url + "/v1/completions", json={**http_request(PROMPTS[0], 1, False), "model": MODEL_NAME},
                       timeout=30)
    except httpx.HTTPError as exc:
        return f"the appliance's HTTP app did not answer POST /v1/completions ({exc})"
    if r.status_code == 200 and "choices" in r.text:
        return None
    return (f"the appliance's HTTP app has no completions endpoint yet (POST /v1/completions -> HTTP {r.status_code} "
            f"{' '.join(r.text.split())[:160]}); so far it serves only /v1/health")


# -- measurement ----------------------------------------------------------------------------------------------------

def rounds(paths: Sequence[Contender], n_rounds: int, block: int, run: Callable[[Contender, str], Sample],
           record: Callable[[Contender, int, Sample, bool], None], rng: random.Random, lead: int = 0) -> None:
    """``n_rounds`` rounds; in each, every path (in a fresh random order) runs ``lead + block`` requests back to
    back after a pause of ``SETTLE_S``. The pause lets the previous path's llama.cpp worker threads stop spinning
    (they spin for about 10 ms after a decode, on one of the cores the next path needs); the ``lead`` requests
    bring the path to its steady state and are not timed. Prompts alternate request by request and turn by turn
    (a prompt can follow itself only on an untimed ``lead`` request, so no timed request is a prefix-cache hit)."""
    for r in range(n_rounds):
        order = list(paths)
        rng.shuffle(order)
        for path in order:
            time.sleep(SETTLE_S)
            for i in range(lead + block):
                prompt_index = (r + i) % len(PROMPTS)
                record(path, prompt_index, run(path, PROMPTS[prompt_index]), i >= lead)


def ms(seconds: float) -> float:
    return seconds * 1e3


def quantiles_ms(samples: Sequence[float]) -> dict[str, float]:
    qs = statistics.quantiles(samples, n=10) if len(samples) > 1 else [samples[0]] * 9
    return {"median_ms": ms(statistics.median(samples)), "p10_ms": ms(qs[0]), "p90_ms": ms(qs[-1]),
            "min_ms": ms(min(samples))}


def measure(paths: list[Contender], args: argparse.Namespace) -> dict[str, Any]:
    one: dict[str, list[Sample]] = {p.name: [] for p in paths}
    streamed: dict[str, list[Sample]] = {p.name: [] for p in paths}
    texts_one: dict[str, dict[int, set[str]]] = {p.name: {} for p in paths}
    texts_stream: dict[str, dict[int, set[str]]] = {p.name: {} for p in paths}

    def rec_one(p: Contender, i: int, s: Sample, timed: bool) -> None:
        texts_one[p.name].setdefault(i, set()).add(s.text)
        if timed:
            one[p.name].append(s)

    def rec_stream(p: Contender, i: int, s: Sample, timed: bool) -> None:
        texts_stream[p.name].setdefault(i, set()).add(s.text)
        if timed:
            streamed[p.name].append(s)

    rng = random.Random(0)
    n = args.stream_tokens
    one_req: Callable[[Contender, str], Sample] = lambda p, prompt: p.one(prompt)  # noqa: E731
    stream_req: Callable[[Contender, str], Sample] = lambda p, prompt: p.stream(prompt, n)  # noqa: E731
    rounds(paths, 1, args.warmup, one_req, lambda p, i, s, t: rec_one(p, i, s, False), rng)  # warm-up: texts only
    rounds(paths, 1, 2, stream_req, lambda p, i, s, t: rec_stream(p, i, s, False), rng)
    block = min(BLOCK, args.requests)
    rounds(paths, -(-args.requests // block), block, one_req, rec_one, rng, lead=1)
    rounds(paths, args.streams, 1, stream_req, rec_stream, rng)
    return {"one": one, "stream": streamed, "texts_one": texts_one, "texts_stream": texts_stream}


def summarize(paths: list[Contender], raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    base = "library"
    ref_one = raw["texts_one"][base]
    ref_stream = raw["texts_stream"][base]
    out: dict[str, Any] = {}
    for p in paths:
        one, streamed = raw["one"][p.name], raw["stream"][p.name]
        t_one = [s.elapsed_s for s in one]
        t_stream = [s.elapsed_s for s in streamed]
        ttft = [s.ttft_s for s in streamed if s.ttft_s is not None]
        med_stream = statistics.median(t_stream)
        texts_one = {PROMPTS[i]: sorted(t) for i, t in sorted(raw["texts_one"][p.name].items())}
        texts_stream = {PROMPTS[i]: sorted(t) for i, t in sorted(raw["texts_stream"][p.name].items())}
        out[p.name] = {
            "label": p.label, "kind": p.kind,
            "one_token": {**quantiles_ms(t_one), "requests": len(t_one),
                          "completion_tokens": sorted({s.tokens for s in one})},
            "stream": {**quantiles_ms(t_stream), "streams": len(t_stream),
                       "completion_tokens": sorted({s.tokens for s in streamed}),
                       "tokens_per_s": args.stream_tokens / med_stream,
                       "ttft_median_ms": ms(statistics.median(ttft)) if ttft else None},
            "texts": {"one_token": texts_one, "stream": texts_stream},
            "text_matches_library": (raw["texts_one"][p.name] == ref_one and raw["texts_stream"][p.name] == ref_stream
                                     and all(len(v) == 1 for v in ref_one.values())
                                     and all(len(v) == 1 for v in ref_stream.values())),
            "all_streams_full_length": all(s.tokens == args.stream_tokens for s in streamed),
        }
    lib = out[base]
    for name, r in out.items():
        r["one_token"]["overhead_ms"] = r["one_token"]["median_ms"] - lib["one_token"]["median_ms"]
        r["one_token"]["paired_overhead_ms"] = ms(statistics.median(
            a.elapsed_s - b.elapsed_s for a, b in zip(raw["one"][name], raw["one"][base], strict=True)))
        r["stream"]["tokens_per_s_ratio"] = r["stream"]["tokens_per_s"] / lib["stream"]["tokens_per_s"]
    return out


def split_of(results: dict[str, Any]) -> dict[str, Any]:
    """Where MAGN's 1-token overhead goes: each step is the difference of two adjacent medians."""
    med = {k: v["one_token"]["median_ms"] for k, v in results.items()}
    split: dict[str, Any] = {
        "engine_ms": med["engine"] - med["library"],
        "daemon_core_ms": med["daemon"] - med["engine"],
        "transport_ms": med["magn_raw"] - med["daemon"],
        "client_async_ms": med["magn_async"] - med["magn_raw"],
        "client_blocking_ms": med["magn"] - med["magn_raw"],
        "blocking_wrapper_ms": med["magn"] - med["magn_async"],
    }
    split["explained"] = ("engine = appliance Runtime vs llama-cpp-python (same thread); daemon_core = Daemon.complete "
                          "in an event loop vs Runtime (engine-thread hop, bookkeeping); transport = minimal MAGN "
                          "client to the appliance process vs Daemon.complete (framing, socket, server session, "
                          "process boundary); client_* = the shipped clients vs the minimal one; blocking_wrapper = "
                          "MagnClient vs AsyncMagnClient")
    return split


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = model_path(args.model_dir, args.layers, args.dim)
    n_batch = min(512, args.n_ctx)
    state = Path(tempfile.mkdtemp(prefix="ap-proto-"))  # short: AF_UNIX paths are limited to 108 bytes
    procs: list[Process] = []
    paths: list[Contender] = []
    compute: ComputeThread | None = None
    http_notes: dict[str, str] = {}
    try:
        http_port = free_port()
        config_text = appliance_config(model, state, n_ctx=args.n_ctx, threads=args.threads, http_port=http_port)
        (state / "appliance.yaml").write_text(config_text)
        appliance = Process([sys.executable, "-m", "appliance", "--log-level", "warning", "run", "--config",
                             str(state / "appliance.yaml")], state / "appliance.log")
        procs.append(appliance)

        compute = ComputeThread(args.threads)
        rt = compute.call(lambda: Runtime(model, n_ctx=args.n_ctx, n_gpu_layers=0, n_threads=args.threads))
        params = rt.llm.context_params  # the library gets exactly the engine's context parameters
        for reset in (True, False):
            llm = compute.call(lambda: llama_cpp.Llama(
                model_path=str(model), n_ctx=args.n_ctx, n_batch=n_batch, n_threads=params.n_threads,
                n_threads_batch=params.n_threads_batch, n_gpu_layers=0, seed=0, verbose=False))
            paths.append(Library(compute, llm, reset=reset))
        paths += [EngineDirect(compute, rt), DaemonCore(compute, config_text, state)]

        http_why = "--no-http was given" if args.no_http else llama_server_missing()
        server: Process | None = None
        if http_why is None:
            port = free_port()
            server = start_llama_server(model, port, params, args.n_ctx, n_batch, state / "llama_server.log")
            procs.append(server)

        def appliance_ready() -> bool:
            with MagnClient(str(state / "a.sock"), timeout=2) as client:
                client.protocol_info()
            return True

        appliance.wait_until(appliance_ready, "the appliance")
        paths += [MagnRaw(state / "a.sock"), MagnAsync(state / "a.sock"), MagnBlocking(state / "a.sock")]
        if args.no_http:
            http_notes["appliance"] = f"skipped: {http_why}"
        else:
            appliance_http_why = probe_appliance_http(f"http://127.0.0.1:{http_port}")
            if appliance_http_why is None:
                paths.append(Http("http_appliance", "HTTP, the appliance's /v1/completions (httpx keep-alive)",
                                  f"http://127.0.0.1:{http_port}", {"model": MODEL_NAME}))
                http_notes["appliance"] = "measured"
            else:
                http_notes["appliance"] = f"skipped: {appliance_http_why}"
        if server is not None:
            paths.append(Http("http_llama_cpp_server", "HTTP, llama_cpp.server /v1/completions (httpx keep-alive)",
                              f"http://127.0.0.1:{port}"))
            http_notes["llama_cpp_server"] = "measured"
        else:
            http_notes["llama_cpp_server"] = f"skipped: {http_why}"
        for what, note in http_notes.items():
            if note != "measured":
                print(f"note: HTTP path {what}: {note}", flush=True)

        tokenized = [rt.tokenize(p, bos=True) for p in PROMPTS]
        if len({len(t) for t in tokenized}) != 1 or tokenized[0][1] == tokenized[1][1]:
            raise RuntimeError(f"the prompts must have equal token counts and differ after BOS: {tokenized}")

        start = time.perf_counter()
        raw = measure(paths, args)
        wall_s = time.perf_counter() - start
        results = summarize(paths, raw, args)
    finally:
        for p in paths:
            with contextlib.suppress(Exception):
                p.close()
        if compute is not None:
            compute.close()
        for proc in procs:
            proc.stop()
        shutil.rmtree(state, ignore_errors=True)
    return report(args, model, results, http_notes, len(tokenized[0]), wall_s)


def report(args: argparse.Namespace, model: Path, results: dict[str, Any], http_notes: dict[str, str],
           prompt_tokens: int, wall_s: float) -> dict[str, Any]:
    lib, magn, magn_async = results["library"], results["magn"], results["magn_async"]
    overhead = magn["one_token"]["overhead_ms"]
    async_overhead = magn_async["one_token"]["overhead_ms"]
    ratio = magn["stream"]["tokens_per_s_ratio"]
    async_ratio = magn_async["stream"]["tokens_per_s_ratio"]
    correct = all(r["text_matches_library"] and r["all_streams_full_length"] for r in results.values())
    http = results.get("http_llama_cpp_server")
    http_part = (f"HTTP llama_cpp.server {http['one_token']['median_ms']:.2f} ms "
                 f"(+{http['one_token']['overhead_ms']:.2f} ms)" if http else "HTTP llama_cpp.server skipped")
    appl_http = results.get("http_appliance")
    if appl_http:
        http_part += (f", HTTP appliance {appl_http['one_token']['median_ms']:.2f} ms "
                      f"(+{appl_http['one_token']['overhead_ms']:.2f} ms)")
    headline = (f"HEADLINE: protocol 1-token: in-process {lib['one_token']['median_ms']:.2f} ms, "
                f"MAGN {magn['one_token']['median_ms']:.2f} ms ({overhead:+.2f} ms; AsyncMagnClient "
                f"{async_overhead:+.2f} ms), {http_part}; {args.stream_tokens}-token stream: MAGN {ratio:.2f}x "
                f"(async {async_ratio:.2f}x) in-process tokens/s"
                f"{'' if correct else '; texts DIFFER'}")
    return {
        "benchmark": NAME,
        "quick": args.quick,
        "model": {"file": model.name, "layers": args.layers, "dim": args.dim, "dtype": "f16"},
        "n_ctx": args.n_ctx,
        "threads": args.threads,
        "prompts": list(PROMPTS),
        "prompt_tokens": prompt_tokens,
        "requests": args.requests,
        "streams": args.streams,
        "warmup": args.warmup,
        "stream_tokens": args.stream_tokens,
        "wall_s": wall_s,
        "paths": results,
        "http": http_notes,
        "split_ms": split_of(results),
        "targets": {"magn_overhead_ms_below": TARGET_OVERHEAD_MS, "magn_stream_ratio_at_least": TARGET_STREAM_RATIO},
        "meets_targets": {
            "magn_overhead": overhead < TARGET_OVERHEAD_MS,
            "magn_async_overhead": async_overhead < TARGET_OVERHEAD_MS,
            "magn_stream": ratio >= TARGET_STREAM_RATIO,
            "magn_async_stream": async_ratio >= TARGET_STREAM_RATIO,
        },
        "texts_match": correct,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "llama_cpp_python": llama_cpp.__version__},
        "units": "ms are medians over the interleaved rounds; overhead_ms = median(path) - median(library); "
                 "paired_overhead_ms = median of per-round differences; tokens_per_s = stream_tokens / median "
                 "stream time (request sent to last token)",
        "headline": headline,
    }


def print_table(r: dict[str, Any]) -> None:
    print(f"model {r['model']['file']}, n_ctx {r['n_ctx']}, {r['threads']} threads, prompts of {r['prompt_tokens']} "
          f"tokens; medians of {r['requests']} 1-token requests and {r['streams']} {r['stream_tokens']}-token "
          f"streams per path, interleaved")
    print(f"{'path':<58} {'1-tok ms':>9} {'+ms':>7} {'p90 ms':>7} {'stream ms':>10} {'tok/s':>7} {'ratio':>6} "
          f"{'ttft ms':>8} text")
    for name, p in r["paths"].items():
        one, st = p["one_token"], p["stream"]
        ttft = f"{st['ttft_median_ms']:.2f}" if st["ttft_median_ms"] is not None else "-"
        print(f"{name + ': ' + p['label']:<58.58} {one['median_ms']:>9.3f} {one['overhead_ms']:>+7.3f} "
              f"{one['p90_ms']:>7.2f} {st['median_ms']:>10.2f} {st['tokens_per_s']:>7.0f} "
              f"{st['tokens_per_s_ratio']:>6.3f} {ttft:>8} "
              f"{'ok' if p['text_matches_library'] and p['all_streams_full_length'] else 'DIFFERS'}")
    for what, note in r["http"].items():
        if note != "measured":
            print(f"HTTP path {what}: {note}")
    s = r["split_ms"]
    print(f"MAGN 1-token overhead split (ms): engine {s['engine_ms']:+.3f}, daemon core {s['daemon_core_ms']:+.3f}, "
          f"transport {s['transport_ms']:+.3f}, client: AsyncMagnClient {s['client_async_ms']:+.3f} / "
          f"MagnClient {s['client_blocking_ms']:+.3f}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.protocol", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="20 1-token requests and 3 streams per path")
    p.add_argument("--requests", type=int, default=None, help="1-token requests per path (default 200; quick 20)")
    p.add_argument("--streams", type=int, default=None, help="64-token streams per path (default 30; quick 3)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed 1-token requests per path first (default 30; quick 4), then 2 streams each")
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--no-http", action="store_true", help="skip the HTTP paths (no server is started)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--threads", type=int, default=max(1, min(4, os.cpu_count() or 1)))
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="cache of generated models")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / f"{NAME}.json", help="where to write the JSON")
    args = p.parse_args(argv)
    full = {"requests": 200, "streams": 30, "warmup": 30}
    quick = {"requests": 20, "streams": 3, "warmup": 4}
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.requests < 1 or args.streams < 1 or args.warmup < 1 or args.stream_tokens < 2:
        p.error("--requests, --streams and --warmup must be >= 1, --stream-tokens >= 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"results: {args.out}")
    print(result["headline"])
    return 0 if result["texts_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
