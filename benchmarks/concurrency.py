"""Concurrent agents on one model: the appliance's batched engine against itself one agent at a time and against
llama.cpp's own ``llama-server -np N`` (SPEC L9, issue #11).

One run, one model (12 layers x 768, f16), the same threads everywhere (2). For N in 1, 2, 4, 8 agents, each agent
sends its own 64-token prompt (BOS included; distinct per agent) and streams 64 greedy tokens, all N at once:

* **appliance batched**: ``python -m appliance run`` (its own process) with ``engine.live_slots: 8``; each agent
  streams ``POST /v1/completions`` (``user`` names the agent) on its own connection;
* **appliance one-at-a-time**: the same with ``engine.live_slots: 1`` (the engine before batching);
* **llama-server -np N**: llama.cpp's server built from the llama.cpp vendored in the pinned llama-cpp-python's
  sdist (``python -m benchmarks.peer build``; skipped with a note when not built, ``--build`` builds it first);
* **llama-batched-bench**: the generation tokens/s of N sequences from the same build, the ceiling of this box.

Each agent's prompt is chosen so that its greedy continuation is 64 tokens of plain text (no EOS, no lone bytes of
a multi-byte character), computed alone in-process first; every streamed text is compared with it.

For each N, every path gets a fresh server (so its peak RSS is its own) and two untimed warm-up requests; then
``--rounds`` rounds (3), each path in a fresh random order running one burst of the N agents (new agent names each
round, so no prompt is found in a cache). Per path and N: aggregate tokens/s (every streamed token / wall time from
the first request sent to the last token; the median over the rounds), TTFT P50/P99 (client side, over every agent
of every round) and the server process's peak RSS (VmHWM).

Targets (issue #11): appliance batched with 4 agents >= 1.6x its one-at-a-time figure, with 8 >= 2.0x; at least
llama-server's tokens/s at every N; TTFT P99 no worse than llama-server's. Exit 1 when a stream did not deliver
exactly its tokens (the figures would not compare).

Run ``python -m benchmarks.concurrency`` (``--quick`` for a seconds-long smoke run on the 4x256 model, without the
peer with ``--no-peer``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import llama_cpp
import numpy as np
import yaml

from appliance.benchmark.session import PROMPT_WORDS, chunk_text, completion_chunks, percentile
from appliance.config.schema import SETTINGS
from benchmarks import peer
from benchmarks.common import add_output_args, fill_defaults, finish, machine, tiny_model
from benchmarks.protocol.servers import Process, appliance_config, free_port
from benchmarks.protocol.workload import MODEL_NAME

NAME = "concurrency"
SLOTS_KEY = "live_slots"
"""The engine setting that bounds the sequences of a live context (SPEC L9): 8 for batched, 1 for one at a time."""
BATCHED_SLOTS = 8
TARGET_RATIO_4 = 1.6
TARGET_RATIO_8 = 2.0
REQUEST_TIMEOUT_S = 600.0
WARMUP_PROMPT = "Hello world, this is a warm up"
WARMUP_TOKENS = 4
WARMUP_REQUESTS = 2
NOISY_SHARE = 0.05
SETTLE_S = 0.2  # pause before each burst: the previous server's llama.cpp threads stop spinning
PROMPT_CANDIDATES = 400
NEAR_TIE = 0.005
"""A greedy step whose best two logits are closer than this is a near-tie: a batch of several sequences rounds a
little differently from a solo run (up to ~5e-4 measured), which may flip it, so such prompts are not used (the
texts compare exactly)."""


@dataclass(frozen=True)
class PathSpec:
    """One way of serving the agents."""

    name: str
    label: str
    kind: str  # appliance | llama-server
    live_slots: int | None = None  # the appliance's engine.live_slots
    flash_attention: bool = False  # the appliance's engine.flash_attention (informational: texts may differ)


def appliance_paths() -> tuple[PathSpec, PathSpec, PathSpec]:
    return (PathSpec("appliance_batched", f"appliance, engine.{SLOTS_KEY}: {BATCHED_SLOTS}", "appliance",
                     BATCHED_SLOTS),
            PathSpec("appliance_one_at_a_time", f"appliance, engine.{SLOTS_KEY}: 1", "appliance", 1),
            PathSpec("appliance_flash", f"appliance, engine.{SLOTS_KEY}: {BATCHED_SLOTS}, flash_attention: true",
                     "appliance", BATCHED_SLOTS, flash_attention=True))


LLAMA_SERVER = PathSpec("llama_server", "llama-server -np N", "llama-server")


def engine_settings(path: PathSpec, threads: int) -> dict[str, int | bool]:
    """The ``engine:`` keys the appliance runs with on ``path``; the one place :data:`SLOTS_KEY` is set."""
    if path.live_slots is None:
        raise ValueError(f"{path.name} is not an appliance path")
    settings: dict[str, int | bool] = {"threads": threads, SLOTS_KEY: path.live_slots}
    if path.flash_attention:
        settings["flash_attention"] = True
    return settings


def slots_setting_missing() -> str | None:
    """Why the appliance cannot be configured with ``engine.live_slots`` yet, or None when it can."""
    if any(setting.key == f"engine.{SLOTS_KEY}" for setting in SETTINGS):
        return None
    return f"the appliance has no engine.{SLOTS_KEY} setting yet (its strict config would refuse it)"


def concurrency_config(model: Path, state: Path, *, n_ctx: int, http_port: int, engine: dict[str, int | bool]) -> str:
    """The benchmark's appliance config (``benchmarks.protocol``'s) with these ``engine:`` keys."""
    doc = yaml.safe_load(appliance_config(model, state, n_ctx=n_ctx, threads=engine["threads"], http_port=http_port))
    doc["engine"].update(engine)
    return yaml.safe_dump(doc, sort_keys=False)


@dataclass(frozen=True)
class AgentPrompt:
    """An agent's prompt and its greedy continuation computed alone, in-process (the reference every path's
    streamed text is compared with)."""

    text: str
    solo: str


def _prompt_text(seed: int, n_tokens: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(PROMPT_WORDS) for _ in range(n_tokens - 1))


def _greedy_clean(llm: llama_cpp.Llama, tokens: list[int], n_gen: int) -> list[int] | None:
    """The first ``n_gen`` greedy tokens after ``tokens``, or None when the model would end (EOS) before them, one
    of them is not text on its own (a byte of a multi-byte character: servers hold such pieces back, so streamed
    token timings and texts would not compare), or one was a near-tie (:data:`NEAR_TIE`)."""
    generated: list[int] = []
    for token in llm.generate(tokens, temp=0.0):
        if token == llm.token_eos():
            return None
        try:
            llm.detokenize([token]).decode("utf-8")
        except UnicodeDecodeError:
            return None
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
        second, best = np.partition(logits, -2)[-2:]
        if best - second < NEAR_TIE:
            return None
        generated.append(token)
        if len(generated) == n_gen:
            return generated
    return None


def agent_prompts(model: Path, n_agents: int, n_prompt: int, n_gen: int, threads: int) -> list[AgentPrompt]:
    """``n_agents`` distinct prompts of exactly ``n_prompt`` tokens each (BOS included; words of the tiny vocabulary
    in a seeded random order), each chosen so that its greedy continuation fills ``n_gen`` tokens of plain text;
    with that continuation, computed alone in-process."""
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=n_prompt + n_gen + 16, n_threads=threads,
                          n_threads_batch=threads, n_gpu_layers=0, verbose=False)
    prompts: list[AgentPrompt] = []
    try:
        for seed in range(PROMPT_CANDIDATES):
            text = _prompt_text(seed, n_prompt)
            tokens = llm.tokenize(text.encode(), add_bos=True)
            if len(tokens) != n_prompt:
                raise RuntimeError(f"prompt {seed} is {len(tokens)} tokens, not {n_prompt}: {text!r}")
            generated = _greedy_clean(llm, tokens, n_gen)
            if generated is not None:
                solo = llm.detokenize(generated, prev_tokens=tokens).decode("utf-8")
                prompts.append(AgentPrompt(text, solo))
            if len(prompts) == n_agents:
                return prompts
    finally:
        llm.close()
    raise RuntimeError(f"only {len(prompts)} of {PROMPT_CANDIDATES} candidate prompts continue with {n_gen} tokens "
                       f"of plain text on {model.name}; {n_agents} are needed")


@dataclass
class Stream:
    """One agent's streamed request: when it was sent, its first and last token, its text and token count."""

    sent: float = 0.0
    first_token: float | None = None
    last_token: float | None = None
    text: str = ""
    tokens: int = 0
    error: str | None = None


def completion_body(kind: str, prompt: str, max_tokens: int, agent: str | None) -> dict[str, Any]:
    """The streamed greedy ``/v1/completions`` body for a server of ``kind``."""
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                            "stream_options": {"include_usage": True}}
    if kind == "appliance":
        body["model"] = MODEL_NAME
        if agent is not None:
            body["user"] = agent
    else:
        body["ignore_eos"] = True  # llama.cpp's own way to generate exactly max_tokens
        body["cache_prompt"] = False
    return body


def stream_completion(base_url: str, body: dict[str, Any], result: Stream, start: threading.Barrier | None) -> None:
    """Stream one completion into ``result`` (times from ``time.perf_counter``); tokens from the usage chunk, else
    one per text chunk."""
    usage_tokens: int | None = None
    chunk_tokens = 0
    parts: list[str] = []
    try:
        with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as http:
            if start is not None:
                start.wait()
            result.sent = time.perf_counter()
            for chunk in completion_chunks(http, body):
                if chunk.get("usage"):
                    usage_tokens = int(chunk["usage"]["completion_tokens"])
                text = chunk_text(chunk)
                if not text:
                    continue
                now = time.perf_counter()
                if result.first_token is None:
                    result.first_token = now
                result.last_token = now
                parts.append(text)
                chunk_tokens += 1
    except Exception as exc:  # recorded per agent; the run reports it and exits 1
        result.error = f"{type(exc).__name__}: {exc}"
    result.text = "".join(parts)
    result.tokens = chunk_tokens if usage_tokens is None else usage_tokens


def run_agents(base_url: str, kind: str, prompts: Sequence[AgentPrompt], max_tokens: int, tag: str) -> list[Stream]:
    """All agents stream at once, each on its own connection and thread, released together."""
    streams = [Stream() for _ in prompts]
    barrier = threading.Barrier(len(prompts))
    threads = []
    for index, prompt in enumerate(prompts):
        body = completion_body(kind, prompt.text, max_tokens, f"{tag}-agent{index}")
        thread = threading.Thread(target=stream_completion, args=(base_url, body, streams[index], barrier),
                                  daemon=True)
        threads.append(thread)
        thread.start()
    for thread in threads:
        thread.join(REQUEST_TIMEOUT_S + 30)
    return streams


def warm_up(base_url: str, kind: str) -> None:
    """Untimed stateless requests, one after another (the model loaded, the caches filled, the threads spun up)."""
    for _ in range(WARMUP_REQUESTS):
        result = Stream()
        stream_completion(base_url, completion_body(kind, WARMUP_PROMPT, WARMUP_TOKENS, None), result, None)
        if result.error is not None:
            raise RuntimeError(f"warm-up request failed: {result.error}")


def burst_figures(streams: Sequence[Stream]) -> tuple[float, float, list[float]] | None:
    """One burst's aggregate tokens/s, wall time and TTFTs (ms), or None when a stream failed or got no token."""
    if any(s.error is not None or s.first_token is None or s.last_token is None for s in streams):
        return None
    wall = max(s.last_token or 0.0 for s in streams) - min(s.sent for s in streams)
    ttft_ms = [((s.first_token or 0.0) - s.sent) * 1e3 for s in streams]
    return sum(s.tokens for s in streams) / wall, wall, ttft_ms


def summarize_bursts(bursts: Sequence[Sequence[Stream]], prompts: Sequence[AgentPrompt], max_tokens: int,
                     peak_rss: int) -> dict[str, Any]:
    """One (path, N): the median over the rounds of each burst's aggregate tokens/s, TTFT P50/P99 over every agent
    of every round, token counts and texts (against each agent's solo text)."""
    errors = [s.error for burst in bursts for s in burst if s.error is not None]
    entry: dict[str, Any] = {
        "agents": len(prompts), "rounds": len(bursts), "tokens": [[s.tokens for s in burst] for burst in bursts],
        "tokens_complete": not errors and all(s.tokens == max_tokens for burst in bursts for s in burst),
        "errors": errors, "peak_rss_bytes": peak_rss,
        "texts_match_solo": [s.text == p.solo for burst in bursts for s, p in zip(burst, prompts, strict=True)],
        "texts_differing": [{"round": r, "agent": a, "text": s.text, "solo": p.solo}
                            for r, burst in enumerate(bursts)
                            for a, (s, p) in enumerate(zip(burst, prompts, strict=True)) if s.text != p.solo]}
    figures = [burst_figures(burst) for burst in bursts]
    if any(f is None for f in figures):
        entry.update({"tokens_per_s": None, "tokens_per_s_rounds": None, "wall_s_rounds": None, "ttft_ms": None,
                      "ttft_p50_ms": None, "ttft_p99_ms": None})
        return entry
    done = [f for f in figures if f is not None]
    ttft_ms = [t for f in done for t in f[2]]
    entry.update({"tokens_per_s": statistics.median(f[0] for f in done), "tokens_per_s_rounds": [f[0] for f in done],
                  "wall_s_rounds": [f[1] for f in done], "ttft_ms": ttft_ms,
                  "ttft_p50_ms": percentile(ttft_ms, 50), "ttft_p99_ms": percentile(ttft_ms, 99)})
    return entry


@dataclass(frozen=True)
class Served:
    """A server under test: where it answers, its process and its log."""

    base_url: str
    pid: int
    log: Path

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""


@contextlib.contextmanager
def appliance_server(model: Path, path: PathSpec, args: argparse.Namespace) -> Iterator[Served]:
    """The appliance in its own process with ``path``'s engine settings, once it answers ``/v1/health``."""
    state = Path(tempfile.mkdtemp(prefix="ap-conc-"))  # short: AF_UNIX paths are limited to 108 bytes
    port = free_port()
    config = concurrency_config(model, state, n_ctx=args.n_ctx, http_port=port,
                                engine=engine_settings(path, args.threads))
    (state / "appliance.yaml").write_text(config)
    proc = Process([sys.executable, "-m", "appliance", "--log-level", "warning", "run", "--config",
                    str(state / "appliance.yaml")], state / "appliance.log")
    base_url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        return httpx.get(base_url + "/v1/health", timeout=2).status_code == 200

    try:
        proc.wait_until(ready, f"the appliance ({path.label})")
        yield Served(base_url, proc.proc.pid, proc.log)
    finally:
        proc.stop()
        shutil.rmtree(state, ignore_errors=True)


@contextlib.contextmanager
def llama_server(binary: Path, model: Path, n: int, args: argparse.Namespace) -> Iterator[Served]:
    """``llama-server -np n``, each slot room for one agent's prompt and tokens (and 64 spare)."""
    slot_ctx = args.prompt_tokens + args.tokens + 64
    log = Path(tempfile.gettempdir()) / f"conc-llama-server-{n}.log"
    with peer.LlamaServer(binary, model, n_parallel=n, threads=args.threads, n_ctx=slot_ctx, log=log) as server:
        yield Served(server.base_url, server.pid, log)


def measure_n(model: Path, paths: Sequence[PathSpec], binaries: dict[str, Path] | None,
              prompts: Sequence[AgentPrompt], n: int, args: argparse.Namespace,
              rng: random.Random) -> dict[str, dict[str, Any]]:
    """N agents on every path: each path's server started and warmed up, then ``args.rounds`` rounds; in each, the
    paths in a fresh random order, each running one burst of N agents (new agent names every round)."""
    with contextlib.ExitStack() as stack:
        servers: dict[str, Served] = {}
        for path in paths:
            if path.kind == "appliance":
                servers[path.name] = stack.enter_context(appliance_server(model, path, args))
            else:
                assert binaries is not None
                servers[path.name] = stack.enter_context(llama_server(binaries["llama-server"], model, n, args))
        for path in paths:
            try:
                warm_up(servers[path.name].base_url, path.kind)
            except RuntimeError as exc:
                raise RuntimeError(f"{path.label}: {exc}\nserver log:\n{servers[path.name].tail()}") from exc
        bursts: dict[str, list[list[Stream]]] = {path.name: [] for path in paths}
        for round_index in range(args.rounds):
            order = list(paths)
            rng.shuffle(order)
            for path in order:
                time.sleep(SETTLE_S)
                tag = f"{path.name}-{n}-r{round_index}"
                bursts[path.name].append(run_agents(servers[path.name].base_url, path.kind, prompts[:n],
                                                    args.tokens, tag))
        out = {}
        for path in paths:
            served = servers[path.name]
            entry = summarize_bursts(bursts[path.name], prompts[:n], args.tokens, peer.peak_rss_bytes(served.pid))
            if entry["errors"]:
                entry["server_log_tail"] = served.tail()
            out[path.name] = entry
    return out


class BoxLoad:
    """CPU time other processes used while the benchmark ran: every busy CPU second of the box (/proc/stat) less
    this process's and its reaped children's (the servers, llama-batched-bench). A shared box is noisy; this says
    how noisy."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.box_start = self._box_busy_s()
        self.own_start = self._own_s()

    @staticmethod
    def _box_busy_s() -> float:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle, iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_s() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def figures(self) -> dict[str, float]:
        wall = time.perf_counter() - self.start
        other = (self._box_busy_s() - self.box_start) - (self._own_s() - self.own_start)
        cpus = os.cpu_count() or 1
        return {"wall_s": wall, "other_processes_cpu_s": max(0.0, other),
                "other_processes_share_of_box": max(0.0, other) / (wall * cpus)}


def ceiling_figures(binary: Path, model: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``llama-batched-bench`` run ``args.rounds`` times; per parallel count the median generation tokens/s."""
    runs = [peer.batched_bench(binary, model, args.threads, n_prompt=args.prompt_tokens, n_gen=args.tokens,
                               n_parallel=tuple(args.agents)) for _ in range(args.rounds)]
    rows = []
    for index, row in enumerate(runs[0]):
        gen = [run[index]["gen_tok_s"] for run in runs]
        rows.append({**row, "gen_tok_s": statistics.median(gen), "gen_tok_s_runs": gen})
    return rows


def peer_binaries(args: argparse.Namespace) -> tuple[dict[str, Path] | None, str]:
    """The peer's binaries and "measured", or None and why they are skipped."""
    if args.no_peer:
        return None, "skipped: --no-peer was given"
    if args.build:
        peer.build()
    binaries = peer.built_binaries()
    if binaries is None:
        return None, (f"skipped: llama.cpp is not built in {peer.default_cache()}; run `python -m benchmarks.peer "
                      f"build` (about 6 minutes on 2 cores) or pass --build")
    return binaries, "measured"


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model(args.model_dir, layers=args.layers, dim=args.dim)
    prompts = agent_prompts(model, max(args.agents), args.prompt_tokens, args.tokens, args.threads)
    binaries, peer_note = peer_binaries(args)
    notes: dict[str, str] = {}
    paths: list[PathSpec] = []
    slots_why = slots_setting_missing()
    for path in appliance_paths():
        if slots_why is None:
            paths.append(path)
            notes[path.name] = "measured"
        else:
            notes[path.name] = f"skipped: {slots_why}"
    notes[LLAMA_SERVER.name] = peer_note
    if binaries is not None:
        paths.append(LLAMA_SERVER)
    for what, note in notes.items():
        if note != "measured":
            print(f"note: {what}: {note}", flush=True)
    start = time.perf_counter()
    load = BoxLoad()
    results: dict[str, dict[str, Any]] = {path.name: {} for path in paths}
    rng = random.Random(0)
    for n in args.agents:
        print(f"measuring {n} agent(s) on {', '.join(path.name for path in paths)} ...", flush=True)
        for name, entry in measure_n(model, paths, binaries, prompts, n, args, rng).items():
            results[name][str(n)] = entry
    ceiling = None
    if binaries is not None:
        print("measuring llama-batched-bench ...", flush=True)
        ceiling = ceiling_figures(binaries["llama-batched-bench"], model, args)
    wall_s = time.perf_counter() - start
    return report(args, model, prompts, paths, results, ceiling, notes, wall_s, load.figures())


def ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


def comparisons(results: dict[str, dict[str, Any]], agents: Sequence[int]) -> dict[str, dict[str, float | None]]:
    """Per N: the appliance batched's tokens/s against one-at-a-time and against llama-server, and its TTFT P99
    against llama-server's."""
    batched = results.get("appliance_batched", {})
    single = results.get("appliance_one_at_a_time", {})
    server = results.get("llama_server", {})
    flash = results.get("appliance_flash", {})
    out: dict[str, dict[str, float | None]] = {}
    for n in agents:
        key = str(n)
        ours = batched.get(key, {})
        out[key] = {"vs_one_at_a_time": ratio(ours.get("tokens_per_s"), single.get(key, {}).get("tokens_per_s")),
                    "vs_llama_server": ratio(ours.get("tokens_per_s"), server.get(key, {}).get("tokens_per_s")),
                    "ttft_p99_vs_llama_server": ratio(ours.get("ttft_p99_ms"),
                                                      server.get(key, {}).get("ttft_p99_ms")),
                    "flash_vs_llama_server": ratio(flash.get(key, {}).get("tokens_per_s"),
                                                   server.get(key, {}).get("tokens_per_s"))}
    return out


def targets_met(compared: dict[str, dict[str, float | None]]) -> dict[str, bool | None]:
    """The issue's targets; None where a side is missing (skipped, or N not run)."""
    def at_least(value: float | None, limit: float) -> bool | None:
        return None if value is None else value >= limit

    def every(values: list[float | None], limit: float, above: bool) -> bool | None:
        if not values or any(v is None for v in values):
            return None
        return all((v >= limit) if above else (v <= limit) for v in values if v is not None)

    return {"batched_4_vs_one_at_a_time": at_least(compared.get("4", {}).get("vs_one_at_a_time"), TARGET_RATIO_4),
            "batched_8_vs_one_at_a_time": at_least(compared.get("8", {}).get("vs_one_at_a_time"), TARGET_RATIO_8),
            "batched_vs_llama_server_every_n": every([c["vs_llama_server"] for c in compared.values()], 1.0, True),
            "ttft_p99_vs_llama_server_every_n": every([c["ttft_p99_vs_llama_server"] for c in compared.values()],
                                                      1.0, False)}


def texts_match_solo(results: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """Per path: whether every agent, at every N, streamed exactly its greedy text computed alone in-process."""
    return {name: all(all(entry["texts_match_solo"]) for entry in per_n.values()) for name, per_n in results.items()}


def headline(args: argparse.Namespace, results: dict[str, dict[str, Any]],
             compared: dict[str, dict[str, float | None]], notes: dict[str, str], load: dict[str, float]) -> str:
    def fmt(value: float | None, suffix: str = "x") -> str:
        return "n/a" if value is None else f"{value:.2f}{suffix}"

    parts = []
    batched = results.get("appliance_batched")
    shown = [n for n in (4, 8) if n in args.agents] or [max(args.agents)]
    if batched is None:
        parts.append(f"appliance {notes['appliance_batched']}")
    else:
        for n in shown:
            entry = batched[str(n)]
            c = compared[str(n)]
            parts.append(f"{n} agents {fmt(entry['tokens_per_s'], ' tok/s')} = {fmt(c['vs_one_at_a_time'])} "
                         f"one-at-a-time, {fmt(c['vs_llama_server'])} llama-server, TTFT P99 "
                         f"{fmt(entry['ttft_p99_ms'], ' ms')} ({fmt(c['ttft_p99_vs_llama_server'])} llama-server's)")
    flash = results.get("appliance_flash")
    if flash is not None and "llama_server" in results:
        n = shown[-1]
        parts.append(f"with engine.flash_attention {n} agents {fmt(flash[str(n)]['tokens_per_s'], ' tok/s')} = "
                     f"{fmt(compared[str(n)]['flash_vs_llama_server'])} llama-server")
    if "llama_server" not in results:
        parts.append("llama-server skipped")
    if load["other_processes_share_of_box"] > NOISY_SHARE:
        parts.append(f"NOISY: other processes used {load['other_processes_share_of_box']:.0%} of the CPU")
    return (f"HEADLINE: concurrency ({args.layers}x{args.dim} f16, {args.threads} threads, {args.prompt_tokens}+"
            f"{args.tokens} tokens per agent): appliance batched " + "; ".join(parts))


def report(args: argparse.Namespace, model: Path, prompts: Sequence[AgentPrompt], paths: list[PathSpec],
           results: dict[str, dict[str, Any]], ceiling: list[dict[str, float | int]] | None, notes: dict[str, str],
           wall_s: float, load: dict[str, float]) -> dict[str, Any]:
    compared = comparisons(results, args.agents)
    complete = all(entry["tokens_complete"] for name, per_n in results.items() if name != "appliance_flash"
                   for entry in per_n.values())  # flash attention may change a text (and its length): informational
    return {
        "benchmark": NAME, "quick": args.quick,
        "model": {"file": model.name, "layers": args.layers, "dim": args.dim, "dtype": "f16"},
        "threads": args.threads, "agents": list(args.agents), "rounds": args.rounds,
        "prompt_tokens": args.prompt_tokens, "tokens": args.tokens, "appliance_n_ctx": args.n_ctx,
        "llama_server_ctx_per_slot": args.prompt_tokens + args.tokens + 64, "wall_s": wall_s, "box_load": load,
        "paths": {path.name: {"label": path.label, "kind": path.kind, "by_agents": results[path.name]}
                  for path in paths},
        "llama_batched_bench": ceiling, "notes": notes, "comparisons": compared,
        "targets": {"batched_4_vs_one_at_a_time_at_least": TARGET_RATIO_4,
                    "batched_8_vs_one_at_a_time_at_least": TARGET_RATIO_8,
                    "batched_vs_llama_server_at_least": 1.0, "ttft_p99_vs_llama_server_at_most": 1.0},
        "meets_targets": targets_met(compared), "tokens_complete": complete,
        "texts_match_solo": texts_match_solo(results),
        "solo_texts": [p.solo for p in prompts], "prompts": [p.text for p in prompts],
        "machine": machine(),
        "units": "tokens_per_s = all streamed tokens / (last token - first request sent), all agents at once; "
                 "ttft = first streamed text - request sent, per agent (client side); peak_rss_bytes = VmHWM of the "
                 "server process; llama_batched_bench gen_tok_s = generation tokens/s of all sequences together",
        "headline": headline(args, results, compared, notes, load),
    }


def print_table(r: dict[str, Any]) -> None:
    print(f"model {r['model']['file']}, {r['threads']} threads, {r['prompt_tokens']}-token prompts, {r['tokens']} "
          f"streamed tokens per agent, all agents at once; tok/s: median of {r['rounds']} rounds (range)")
    print(f"{'path':<24} {'N':>2} {'tok/s':>7} {'range':>13} {'TTFT P50':>9} {'TTFT P99':>9} {'peak RSS':>9} "
          f"{'text':>5} tokens")
    for name, path in r["paths"].items():
        for n, e in path["by_agents"].items():
            tps = "-" if e["tokens_per_s"] is None else f"{e['tokens_per_s']:.1f}"
            spread = "-"
            if e["tokens_per_s_rounds"] is not None:
                spread = f"{min(e['tokens_per_s_rounds']):.0f}-{max(e['tokens_per_s_rounds']):.0f}"
            p50 = "-" if e["ttft_p50_ms"] is None else f"{e['ttft_p50_ms']:.0f} ms"
            p99 = "-" if e["ttft_p99_ms"] is None else f"{e['ttft_p99_ms']:.0f} ms"
            rss = f"{e['peak_rss_bytes'] / 2**20:.0f} MiB"
            counts = "ok" if e["tokens_complete"] else f"SHORT {e['tokens']} {e['errors']}"
            text = "solo" if all(e["texts_match_solo"]) else "DIFF"
            print(f"{name:<24} {n:>2} {tps:>7} {spread:>13} {p50:>9} {p99:>9} {rss:>9} {text:>5} {counts}")
    if r["llama_batched_bench"] is not None:
        row = ", ".join(f"{b['n_parallel']}: {b['gen_tok_s']:.1f}" for b in r["llama_batched_bench"])
        print(f"llama-batched-bench generation tok/s by sequences (the box's ceiling): {row}")
    for n, c in r["comparisons"].items():
        cells = ", ".join(f"{k} {'-' if v is None else f'{v:.2f}x'}" for k, v in c.items())
        print(f"N={n}: appliance batched {cells}")
    for what, note in r["notes"].items():
        if note != "measured":
            print(f"{what}: {note}")
    load = r["box_load"]
    print(f"other processes used {load['other_processes_share_of_box']:.0%} of the box's CPU during the run"
          + (" (NOISY: the figures above are not comparable)" if load["other_processes_share_of_box"] > NOISY_SHARE
             else ""))
    print(f"texts equal to the solo in-process greedy text: {r['texts_match_solo']}; targets met: {r['meets_targets']}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.concurrency", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run (4x256 model, N 1 and 2, 8 tokens)")
    p.add_argument("--agents", type=int, nargs="+", default=None, help="agent counts (default 1 2 4 8; quick 1 2)")
    p.add_argument("--tokens", type=int, default=None, help="streamed tokens per agent (default 64; quick 8)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt tokens per agent, BOS included")
    p.add_argument("--layers", type=int, default=None, help="model layers (default 12; quick 4)")
    p.add_argument("--dim", type=int, default=None, help="model width (default 768; quick 256)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=None, help="bursts per path and N, interleaved (default 3; quick 1)")
    p.add_argument("--n-ctx", type=int, default=2048, help="the appliance model's n_ctx")
    p.add_argument("--no-peer", action="store_true", help="skip llama-server and llama-batched-bench")
    p.add_argument("--build", action="store_true", help="build the peer first when it is not built")
    add_output_args(p, NAME)
    args = p.parse_args(argv)
    fill_defaults(args, full={"agents": [1, 2, 4, 8], "tokens": 64, "layers": 12, "dim": 768, "rounds": 3},
                  quick={"agents": [1, 2], "tokens": 8, "layers": 4, "dim": 256, "rounds": 1})
    if min(args.agents) < 1 or min(args.tokens, args.threads, args.rounds) < 1 or args.prompt_tokens < 2:
        p.error("--agents, --tokens, --threads and --rounds must be >= 1, --prompt-tokens >= 2")
    if args.no_peer and args.build:
        p.error("--build and --no-peer contradict each other")
    args.agents = sorted(set(args.agents))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    return finish(result, args.out, print_table, ok=result["tokens_complete"])


if __name__ == "__main__":
    raise SystemExit(main())
