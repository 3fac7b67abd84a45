"""Concurrent agents on one model: the appliance against llama.cpp's own ``llama-server -np N``, both on their
defaults and with flash attention equal, and against itself one agent at a time.

One run, one model (12 layers x 768, f16), the same threads everywhere (2). For N in 1, 2, 4, 8 agents, each agent
sends its own 64-token prompt (BOS included; distinct per agent) and streams 64 greedy tokens, all N at once:

* **appliance defaults**: ``python -m appliance run`` (its own process) with ``engine.live_slots: 8`` and the threads
  set, every other engine setting (flash attention, the adaptive engine) its default; each agent streams
  ``POST /v1/completions`` (``user`` names the agent) on its own connection;
* **appliance one-at-a-time**: the same with ``engine.live_slots: 1`` (the engine before batching);
* **appliance fixed**: the defaults with ``engine.adaptive: false`` (the fixed strategy: one context of ``n_ctx``
  cells from the start, no tuning), the adaptive engine's own baseline;
* **appliance flash on / off**: ``engine.flash_attention: true`` / ``false``;
* **llama-server defaults / flash on / flash off**: ``llama-server -np N`` without ``--flash-attn`` (its default),
  with ``--flash-attn on`` and ``off``; built from the llama.cpp vendored in the pinned llama-cpp-python's sdist
  (``python -m benchmarks.peer build``; absent with a note when not built, ``--build`` builds it first);
* **llama-batched-bench**: the generation tokens/s of N sequences from the same build, the ceiling of this box.

Each agent's prompt is chosen so that its greedy continuation is 64 tokens of plain text (no EOS, no lone bytes of
a multi-byte character), computed alone in-process first; every streamed text is compared with it.

For each N, every path gets a fresh server (so its peak RSS is its own) and two untimed warm-up requests; then
rounds, each path in a fresh random order running one burst of the N agents (new agent names and new prompts each
round: the appliance shares token prefixes between conversations, so a prompt sent again would be found in its cache
and only the first round would evaluate its prompts, while llama-server runs with ``cache_prompt: false``). A round
during which other processes used more than 10 % of the box's CPU (``/proc/stat`` less this process's and the
servers' ``/proc/<pid>/stat`` ticks) is dropped and re-run, up to ``--max-reruns`` times; with fewer than
``--rounds`` (3) clean rounds the HEADLINE says NOISY. Per path and N, over the kept rounds: aggregate tokens/s
(every streamed token / wall time from the first request sent to the last token; the median), TTFT P50/P99 (client
side, over every agent of every round) and the server process's peak RSS (VmHWM).

Targets: on defaults, at least llama-server's tokens/s at every N and a TTFT P99 no worse than its; the appliance on
defaults with 4 agents >= 1.6x itself one at a time, with 8 >= 2.0x; the adaptive engine (defaults) at least the
fixed strategy's tokens/s and a TTFT P99 no worse than its at every N. Exit 1 when a stream of a path that must
deliver exactly its tokens (llama-server, asked to ignore EOS, and the appliance with flash attention off) did not.

Run ``python -m benchmarks.concurrency`` (``--quick`` for a seconds-long smoke run on the 4x256 model, without the
peer with ``--no-peer``).
"""

from __future__ import annotations

import argparse
import contextlib
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
from benchmarks.common import (
    FOREIGN_CPU_LIMIT,
    BoxLoad,
    add_output_args,
    fill_defaults,
    finish,
    machine,
    run_clean_rounds,
    tiny_model,
)
from benchmarks.protocol.servers import Process, appliance_config, free_port
from benchmarks.protocol.workload import MODEL_NAME

NAME = "concurrency"
SLOTS_KEY = "live_slots"
"""The engine setting that bounds the sequences of a live context (SPEC L9): 8 for batched, 1 for one at a time."""
BATCHED_SLOTS = 8
TARGET_RATIO_4 = 1.6
TARGET_RATIO_8 = 2.0
TARGET_VS_LLAMA_SERVER = 1.0
"""On defaults the appliance's aggregate tokens/s is at least this times llama-server's, and its TTFT P99 at most
llama-server's, at every N."""
TARGET_VS_FIXED = 1.0
"""The adaptive engine (defaults) has at least this times the fixed strategy's tokens/s, and a TTFT P99 at most
its, at every N."""
REQUEST_TIMEOUT_S = 600.0
WARMUP_PROMPT = "Hello world, this is a warm up"
WARMUP_TOKENS = 4
WARMUP_REQUESTS = 2
SETTLE_S = 0.2  # pause before each burst: the previous server's llama.cpp threads stop spinning
PROMPT_CANDIDATES = 400
NEAR_TIE = 0.005
"""A greedy step whose best two logits are closer than this is a near-tie: a batch of several sequences rounds a
little differently from a solo run (up to ~5e-4 measured), which may flip it, so such prompts are not used (the
texts compare exactly)."""


@dataclass(frozen=True)
class PathSpec:
    """One way of serving the agents. ``flash_attention`` None passes no flash attention setting: the server's own
    default."""

    name: str
    label: str
    kind: str  # appliance | llama-server
    live_slots: int | None = None  # the appliance's engine.live_slots
    flash_attention: bool | None = None
    adaptive: bool | None = None  # the appliance's engine.adaptive (None: its default)

    @property
    def strict(self) -> bool:
        """Whether every stream must deliver exactly the asked tokens (the run exits 1 otherwise): llama-server (asked
        to ignore EOS) and the appliance with flash attention off (its texts are the solo ones). With flash attention
        on a batched text may part from the solo one and end early: informational."""
        return self.kind == "llama-server" or self.flash_attention is False


def appliance_paths(flash_off: bool = True) -> list[PathSpec]:
    """The appliance on its defaults (only the slots for 8 agents and the threads set), with the fixed strategy, one
    at a time, and with flash attention on (and off) as the flash-equal partners of llama-server's."""
    paths = [PathSpec("appliance_defaults", f"appliance defaults, engine.{SLOTS_KEY}: {BATCHED_SLOTS}", "appliance",
                      BATCHED_SLOTS),
             PathSpec("appliance_fixed", f"appliance defaults, engine.{SLOTS_KEY}: {BATCHED_SLOTS}, adaptive: false",
                      "appliance", BATCHED_SLOTS, adaptive=False),
             PathSpec("appliance_one_at_a_time", f"appliance defaults, engine.{SLOTS_KEY}: 1", "appliance", 1),
             PathSpec("appliance_flash_on", f"appliance, engine.{SLOTS_KEY}: {BATCHED_SLOTS}, flash_attention: true",
                      "appliance", BATCHED_SLOTS, flash_attention=True)]
    if flash_off:
        paths.append(PathSpec("appliance_flash_off", f"appliance, engine.{SLOTS_KEY}: {BATCHED_SLOTS}, "
                                                     f"flash_attention: false", "appliance", BATCHED_SLOTS,
                              flash_attention=False))
    return paths


def llama_server_paths(flash_off: bool = True) -> list[PathSpec]:
    """``llama-server -np N`` on its defaults (no ``--flash-attn``), with ``--flash-attn on`` (and ``off``)."""
    paths = [PathSpec("llama_server_defaults", "llama-server -np N (defaults)", "llama-server"),
             PathSpec("llama_server_flash_on", "llama-server -np N --flash-attn on", "llama-server",
                      flash_attention=True)]
    if flash_off:
        paths.append(PathSpec("llama_server_flash_off", "llama-server -np N --flash-attn off", "llama-server",
                              flash_attention=False))
    return paths


PAIRS = {"defaults": ("appliance_defaults", "llama_server_defaults"),
         "flash_on": ("appliance_flash_on", "llama_server_flash_on"),
         "flash_off": ("appliance_flash_off", "llama_server_flash_off")}
"""The side-by-side comparisons: each on its own defaults, and with flash attention equal (on; off)."""

SAME_SETTINGS = {"appliance": ("appliance_defaults", "appliance_flash_on"),
                 "llama_server": ("llama_server_defaults", "llama_server_flash_on")}
"""Two servers of one kind that run the same settings once the defaults' flash attention ``auto`` resolved to on:
their ratio is what this run's noise alone makes of a ratio (an A/A pair)."""


def engine_settings(path: PathSpec, threads: int) -> dict[str, int | bool]:
    """The ``engine:`` keys the appliance runs with on ``path``; the one place :data:`SLOTS_KEY` is set. Flash
    attention and the strategy only when the path sets them (else the appliance's own defaults)."""
    if path.live_slots is None:
        raise ValueError(f"{path.name} is not an appliance path")
    settings: dict[str, int | bool] = {"threads": threads, SLOTS_KEY: path.live_slots}
    if path.flash_attention is not None:
        settings["flash_attention"] = path.flash_attention
    if path.adaptive is not None:
        settings["adaptive"] = path.adaptive
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


def round_prompts(prompts: Sequence[AgentPrompt], attempt: int, n: int, per_round: int) -> Sequence[AgentPrompt]:
    """The first ``n`` prompts of round ``attempt``'s own ``per_round`` (the largest N): no round sends a prompt an
    earlier round sent."""
    start = attempt * per_round
    if start + n > len(prompts):
        raise RuntimeError(f"round {attempt} needs prompts {start}-{start + n - 1}, only {len(prompts)} were made")
    return prompts[start:start + n]


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


def live_context(base_url: str) -> dict[str, Any] | None:
    """The appliance's live context as its ``/v1/health`` lists it; None when it has none."""
    contexts = httpx.get(base_url + "/v1/health", timeout=10).json().get("contexts", [])
    return contexts[0] if contexts else None


def appliance_flash(base_url: str) -> bool | None:
    """Whether the appliance's live context runs flash attention (llama.cpp's choice under ``auto``); None when it
    has no live context."""
    context = live_context(base_url)
    return None if context is None else context["flash_attention"]


def appliance_context(base_url: str) -> dict[str, int] | None:
    """The appliance's live context's ``pool_cells`` and ``kv_streams`` (split KV streams, one per live sequence;
    0: one pool every sequence attends over); None when it has none."""
    context = live_context(base_url)
    if context is None:
        return None
    return {"pool_cells": context["pool_cells"], "kv_streams": context["kv_streams"]}


def burst_figures(streams: Sequence[Stream]) -> tuple[float, float, list[float]] | None:
    """One burst's aggregate tokens/s, wall time and TTFTs (ms), or None when a stream failed or got no token."""
    if any(s.error is not None or s.first_token is None or s.last_token is None for s in streams):
        return None
    wall = max(s.last_token or 0.0 for s in streams) - min(s.sent for s in streams)
    ttft_ms = [((s.first_token or 0.0) - s.sent) * 1e3 for s in streams]
    return sum(s.tokens for s in streams) / wall, wall, ttft_ms


def summarize_bursts(bursts: Sequence[Sequence[Stream]], prompts: Sequence[Sequence[AgentPrompt]], max_tokens: int,
                     peak_rss: int) -> dict[str, Any]:
    """One (path, N): the median over the rounds of each burst's aggregate tokens/s, TTFT P50/P99 over every agent
    of every round, token counts and texts (against each agent's solo text); ``prompts``: each burst's."""
    errors = [s.error for burst in bursts for s in burst if s.error is not None]
    entry: dict[str, Any] = {
        "agents": len(prompts[0]), "rounds": len(bursts), "tokens": [[s.tokens for s in burst] for burst in bursts],
        "tokens_complete": not errors and all(s.tokens == max_tokens for burst in bursts for s in burst),
        "errors": errors, "peak_rss_bytes": peak_rss,
        "texts_match_solo": [s.text == p.solo for burst, sent in zip(bursts, prompts, strict=True)
                             for s, p in zip(burst, sent, strict=True)],
        "texts_differing": [{"round": r, "agent": a, "text": s.text, "solo": p.solo}
                            for r, (burst, sent) in enumerate(zip(bursts, prompts, strict=True))
                            for a, (s, p) in enumerate(zip(burst, sent, strict=True)) if s.text != p.solo]}
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
def appliance_server(model: Path, path: PathSpec, args: argparse.Namespace, n: int) -> Iterator[Served]:
    """The appliance in its own process with ``path``'s engine settings, once it answers ``/v1/health`` (for the
    bursts of ``n`` agents)."""
    state = Path(tempfile.mkdtemp(prefix="ap-conc-"))  # short: AF_UNIX paths are limited to 108 bytes
    port = free_port()
    config = concurrency_config(model, state, n_ctx=args.n_ctx, http_port=port,
                                engine=engine_settings(path, args.threads))
    (state / "appliance.yaml").write_text(config)
    level = "warning" if args.keep_logs is None else "info"
    proc = Process([sys.executable, "-m", "appliance", "--log-level", level, "run", "--config",
                    str(state / "appliance.yaml")], state / "appliance.log")
    base_url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        return httpx.get(base_url + "/v1/health", timeout=2).status_code == 200

    try:
        proc.wait_until(ready, f"the appliance ({path.label})")
        yield Served(base_url, proc.proc.pid, proc.log)
    finally:
        proc.stop()
        keep_log(args, n, state / "appliance.log", f"{path.name}.log")
        shutil.rmtree(state, ignore_errors=True)


def keep_log(args: argparse.Namespace, n: int, log: Path, name: str) -> None:
    """With ``--keep-logs DIR``: ``log`` copied into ``DIR/N<agents>/name`` (a server's log is gone with its
    temporary folder otherwise, and a flaky round cannot be read afterwards)."""
    if args.keep_logs is None or not log.exists():
        return
    folder = args.keep_logs / f"N{n}"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(log, folder / name)


@contextlib.contextmanager
def llama_server(binary: Path, model: Path, n: int, path: PathSpec, args: argparse.Namespace) -> Iterator[Served]:
    """``llama-server -np n`` with ``path``'s flash attention, each slot room for one agent's prompt and tokens (and
    64 spare)."""
    slot_ctx = args.prompt_tokens + args.tokens + 64
    log = Path(tempfile.gettempdir()) / f"conc-{path.name}-{n}.log"
    try:
        with peer.LlamaServer(binary, model, n_parallel=n, threads=args.threads, n_ctx=slot_ctx, log=log,
                              flash_attention=path.flash_attention) as server:
            yield Served(server.base_url, server.pid, log)
    finally:
        keep_log(args, n, log, f"{path.name}.log")


def measure_n(model: Path, paths: Sequence[PathSpec], binaries: dict[str, Path] | None,
              prompts: Sequence[AgentPrompt], n: int, args: argparse.Namespace,
              rng: random.Random) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """N agents on every path: each path's server started and warmed up, then rounds (:func:`run_clean_rounds`: a
    round during which other processes used more than :data:`FOREIGN_CPU_LIMIT` of the CPU is dropped and re-run);
    in each, the paths in a fresh random order, each running one burst of N agents (new agent names every round).
    Each path's figures from the kept rounds, and the rounds' record."""
    with contextlib.ExitStack() as stack:
        servers: dict[str, Served] = {}
        for path in paths:
            if path.kind == "appliance":
                servers[path.name] = stack.enter_context(appliance_server(model, path, args, n))
            else:
                assert binaries is not None
                servers[path.name] = stack.enter_context(llama_server(binaries["llama-server"], model, n, path,
                                                                      args))
        resolved: dict[str, bool | None] = {}
        for path in paths:
            try:
                warm_up(servers[path.name].base_url, path.kind)
            except RuntimeError as exc:
                raise RuntimeError(f"{path.label}: {exc}\nserver log:\n{servers[path.name].tail()}") from exc
            if path.kind == "appliance":
                resolved[path.name] = appliance_flash(servers[path.name].base_url)
        bursts: dict[str, dict[int, list[Stream]]] = {path.name: {} for path in paths}

        def one_round(attempt: int) -> None:
            order = list(paths)
            rng.shuffle(order)
            for path in order:
                time.sleep(SETTLE_S)
                tag = f"{path.name}-{n}-r{attempt}"
                sent = round_prompts(prompts, attempt, n, max(args.agents))
                bursts[path.name][attempt] = run_agents(servers[path.name].base_url, path.kind, sent, args.tokens, tag)

        def server_pids() -> list[int]:
            return [served.pid for served in servers.values()]

        rounds = run_clean_rounds(args.rounds, args.max_reruns, one_round, server_pids)
        contexts = {path.name: appliance_context(servers[path.name].base_url)
                    for path in paths if path.kind == "appliance"}
        out = {}
        for path in paths:
            served = servers[path.name]
            kept = [bursts[path.name][attempt] for attempt in rounds["kept_attempts"]]
            kept_prompts = [round_prompts(prompts, attempt, n, max(args.agents))
                            for attempt in rounds["kept_attempts"]]
            entry = summarize_bursts(kept, kept_prompts, args.tokens, peer.peak_rss_bytes(served.pid))
            if entry["errors"]:
                entry["server_log_tail"] = served.tail()
            if path.kind == "appliance":
                entry["flash_attention_resolved"] = resolved[path.name]
                entry["context_after_rounds"] = contexts[path.name]
            out[path.name] = entry
    return out, rounds


def ceiling_figures(binary: Path, model: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """``llama-batched-bench`` run ``args.rounds`` times with a KV stream per sequence (the box's ceiling, as
    llama-server's slots) and as many times with one unified KV buffer (as the appliance's unsplit context), the
    two in each round one after the other, which first alternating (the box's speed drifts between rounds more than
    the layouts differ at one sequence). Per parallel count the median generation tokens/s of each, and the median
    of the rounds' unified / split ratios."""
    split_runs = []
    unified_runs = []
    for index in range(args.rounds):
        order = [(False, split_runs), (True, unified_runs)]
        if index % 2:
            order.reverse()
        for unified, runs in order:
            runs.append(peer.batched_bench(binary, model, args.threads, n_prompt=args.prompt_tokens,
                                           n_gen=args.tokens, n_parallel=tuple(args.agents), unified=unified))
    rows = []
    for index, row in enumerate(split_runs[0]):
        gen = [run[index]["gen_tok_s"] for run in split_runs]
        gen_unified = [run[index]["gen_tok_s"] for run in unified_runs]
        ratios = [unified / split for unified, split in zip(gen_unified, gen, strict=True)]
        rows.append({**row, "gen_tok_s": statistics.median(gen), "gen_tok_s_runs": gen,
                     "gen_tok_s_unified": statistics.median(gen_unified), "gen_tok_s_unified_runs": gen_unified,
                     "unified_over_split": statistics.median(ratios)})
    return rows


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model(args.model_dir, layers=args.layers, dim=args.dim)
    attempts = args.rounds + args.max_reruns  # every round attempt gets prompts of its own
    prompts = agent_prompts(model, max(args.agents) * attempts, args.prompt_tokens, args.tokens, args.threads)
    binaries, peer_note = peer.binaries_or_why(args.no_peer, args.build, args.peer_cache)
    notes: dict[str, str] = {}
    paths: list[PathSpec] = []
    slots_why = slots_setting_missing()
    for path in appliance_paths(args.flash_off):
        if slots_why is None:
            paths.append(path)
            notes[path.name] = "measured"
        else:
            notes[path.name] = f"absent: {slots_why}"
    for path in llama_server_paths(args.flash_off):
        notes[path.name] = peer_note
        if binaries is not None:
            paths.append(path)
    for what, note in notes.items():
        if note != "measured":
            print(f"note: {what}: {note}", flush=True)
    start = time.perf_counter()
    load = BoxLoad()
    results: dict[str, dict[str, Any]] = {path.name: {} for path in paths}
    rounds: dict[str, dict[str, Any]] = {}
    rng = random.Random(0)
    for n in args.agents:
        print(f"measuring {n} agent(s) on {', '.join(path.name for path in paths)} ...", flush=True)
        entries, rounds[str(n)] = measure_n(model, paths, binaries, prompts, n, args, rng)
        for name, entry in entries.items():
            results[name][str(n)] = entry
    ceiling = None
    flash_resolved: dict[str, str] = {}
    if binaries is not None:
        for path in llama_server_paths(args.flash_off):
            flash_resolved[path.name] = peer.probe_flash_attention(binaries["llama-server"], model, args.threads,
                                                                   path.flash_attention)
        print("measuring llama-batched-bench ...", flush=True)
        ceiling = ceiling_figures(binaries["llama-batched-bench"], model, args)
    wall_s = time.perf_counter() - start
    return report(args, model, prompts, paths, results, rounds, ceiling, notes, flash_resolved, wall_s,
                  load.figures())


def ratio(ours: float | None, theirs: float | None) -> float | None:
    if ours is None or theirs is None or theirs == 0:
        return None
    return ours / theirs


def comparisons(results: dict[str, dict[str, Any]], agents: Sequence[int]) -> dict[str, dict[str, float | None]]:
    """Per N: for each pair of :data:`PAIRS` the appliance's tokens/s and TTFT P99 over llama-server's, the
    appliance on defaults against itself one at a time, and the adaptive engine (defaults) over the fixed strategy
    (tokens/s and TTFT P99)."""
    out: dict[str, dict[str, float | None]] = {}
    for n in agents:
        key = str(n)
        cells: dict[str, float | None] = {}
        for pair, (ours, theirs) in PAIRS.items():
            mine = results.get(ours, {}).get(key, {})
            peer_entry = results.get(theirs, {}).get(key, {})
            cells[f"{pair}_tok_s"] = ratio(mine.get("tokens_per_s"), peer_entry.get("tokens_per_s"))
            cells[f"{pair}_ttft_p99"] = ratio(mine.get("ttft_p99_ms"), peer_entry.get("ttft_p99_ms"))
        cells["vs_one_at_a_time"] = ratio(results.get("appliance_defaults", {}).get(key, {}).get("tokens_per_s"),
                                          results.get("appliance_one_at_a_time", {}).get(key, {}).get("tokens_per_s"))
        adaptive = results.get("appliance_defaults", {}).get(key, {})
        fixed = results.get("appliance_fixed", {}).get(key, {})
        cells["adaptive_vs_fixed_tok_s"] = ratio(adaptive.get("tokens_per_s"), fixed.get("tokens_per_s"))
        cells["adaptive_vs_fixed_ttft_p99"] = ratio(adaptive.get("ttft_p99_ms"), fixed.get("ttft_p99_ms"))
        out[key] = cells
    return out


def same_settings(results: dict[str, dict[str, Any]], flash_resolved: dict[str, str],
                  agents: Sequence[int]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per kind of server (:data:`SAME_SETTINGS`) and N, the tokens/s and TTFT P99 of its defaults over its flash-on
    server when the defaults ran flash attention too (the appliance's ``/v1/health``; llama-server's log, probed):
    two identical servers, so how far these move from 1.0 is this run's noise. A kind is left out when a side is
    absent or its defaults did not resolve to flash attention on."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for kind, (defaults, flash_on) in SAME_SETTINGS.items():
        if defaults not in results or flash_on not in results:
            continue
        cells: dict[str, dict[str, float | None]] = {}
        for n in agents:
            mine = results[defaults].get(str(n), {})
            other = results[flash_on].get(str(n), {})
            if kind == "appliance":
                same = mine.get("flash_attention_resolved") is True
            else:
                same = flash_resolved.get(defaults, "").endswith("enabled")
            if same:
                cells[str(n)] = {"tok_s": ratio(mine.get("tokens_per_s"), other.get("tokens_per_s")),
                                 "ttft_p99": ratio(mine.get("ttft_p99_ms"), other.get("ttft_p99_ms"))}
        if cells:
            out[kind] = cells
    return out


def target_rows(compared: dict[str, dict[str, float | None]]) -> list[dict[str, Any]]:
    """Every target with its value (a ratio) and whether it is met (None: a side is absent, or N not run): on
    defaults, tokens/s >= llama-server's and TTFT P99 <= llama-server's at every N; the appliance on defaults >=
    1.6x itself one at a time with 4 agents, >= 2.0x with 8; the adaptive engine's tokens/s >= the fixed strategy's
    and its TTFT P99 <= the fixed strategy's at every N."""
    def row(key: str, target: str, value: float | None, limit: float, above: bool) -> dict[str, Any]:
        met = None if value is None else (value >= limit if above else value <= limit)
        return {"key": key, "target": target, "value": value, "limit": limit, "met": met}

    rows = []
    for n, cells in compared.items():
        rows.append(row(f"defaults_tok_s_n{n}", f"defaults, N={n}: tok/s >= {TARGET_VS_LLAMA_SERVER:.1f}x "
                                                f"llama-server's", cells["defaults_tok_s"], TARGET_VS_LLAMA_SERVER,
                        True))
        rows.append(row(f"defaults_ttft_p99_n{n}", f"defaults, N={n}: TTFT P99 <= llama-server's",
                        cells["defaults_ttft_p99"], 1.0, False))
    for n, limit in (("4", TARGET_RATIO_4), ("8", TARGET_RATIO_8)):
        value = compared.get(n, {}).get("vs_one_at_a_time")
        rows.append(row(f"vs_one_at_a_time_n{n}", f"defaults, N={n}: tok/s >= {limit:.1f}x one at a time", value,
                        limit, True))
    for n, cells in compared.items():
        rows.append(row(f"adaptive_vs_fixed_tok_s_n{n}", f"adaptive, N={n}: tok/s >= {TARGET_VS_FIXED:.1f}x fixed's",
                        cells.get("adaptive_vs_fixed_tok_s"), TARGET_VS_FIXED, True))
        rows.append(row(f"adaptive_vs_fixed_ttft_p99_n{n}", f"adaptive, N={n}: TTFT P99 <= fixed's",
                        cells.get("adaptive_vs_fixed_ttft_p99"), 1.0, False))
    return rows


def targets_met(compared: dict[str, dict[str, float | None]]) -> dict[str, bool | None]:
    """The targets of :func:`target_rows` by key."""
    return {row["key"]: row["met"] for row in target_rows(compared)}


def texts_match_solo(results: dict[str, dict[str, Any]]) -> dict[str, bool]:
    """Per path: whether every agent, at every N, streamed exactly its greedy text computed alone in-process."""
    return {name: all(all(entry["texts_match_solo"]) for entry in per_n.values()) for name, per_n in results.items()}


def noisy_rounds(rounds: dict[str, dict[str, Any]]) -> list[str]:
    """``N=8 1/3`` for each N with fewer clean rounds than wanted."""
    return [f"N={n} {r['clean']}/{r['wanted']}" for n, r in rounds.items() if r["noisy"]]


def headline(args: argparse.Namespace, results: dict[str, dict[str, Any]],
             compared: dict[str, dict[str, float | None]], notes: dict[str, str],
             rounds: dict[str, dict[str, Any]], targets: list[dict[str, Any]],
             same: dict[str, dict[str, dict[str, float | None]]]) -> str:
    def fmt(value: float | None, suffix: str = "x") -> str:
        return "n/a" if value is None else f"{value:.2f}{suffix}"

    parts = []
    if "llama_server_defaults" in results:
        for pair, label in (("defaults", "on defaults"), ("flash_on", "flash attention on both"),
                            ("flash_off", "flash attention off both")):
            ours, theirs = PAIRS[pair]
            if ours not in results or theirs not in results:
                continue
            cells = ", ".join(f"N={n} {fmt(c[f'{pair}_tok_s'])}" for n, c in compared.items())
            p99 = ", ".join(fmt(c[f"{pair}_ttft_p99"]) for c in compared.values())
            parts.append(f"{label} {cells} (TTFT P99 {p99})")
    else:
        parts.append(f"llama-server {notes['llama_server_defaults'].split(';')[0]}")
        if "appliance_defaults" in results:
            parts.append("appliance defaults " + ", ".join(
                f"N={n} {fmt(e['tokens_per_s'], ' tok/s')}" for n, e in results["appliance_defaults"].items()))
    if "appliance_defaults" in results:
        n = str(max(args.agents))
        parts.append(f"defaults vs one at a time N={n} {fmt(compared[n]['vs_one_at_a_time'])}")
    if "appliance_defaults" in results and "appliance_fixed" in results:
        cells = ", ".join(f"N={n} {fmt(c['adaptive_vs_fixed_tok_s'])}" for n, c in compared.items())
        p99 = ", ".join(fmt(c["adaptive_vs_fixed_ttft_p99"]) for c in compared.values())
        parts.append(f"adaptive / fixed tok/s {cells} (TTFT P99 {p99})")
    for kind, cells_by_n in same.items():
        cells = ", ".join(f"N={n} {fmt(c['tok_s'])}" for n, c in cells_by_n.items())
        p99 = ", ".join(fmt(c["ttft_p99"]) for c in cells_by_n.values())
        parts.append(f"A/A ({kind.replace('_', '-')} defaults / flash on, the same settings) tok/s {cells} "
                     f"(TTFT P99 {p99})")
    known = [row for row in targets if row["met"] is not None]
    parts.append(f"targets met {sum(1 for row in known if row['met'])}/{len(known)}")
    noisy = noisy_rounds(rounds)
    if noisy:
        parts.append(f"NOISY: too few clean rounds ({', '.join(noisy)} under {FOREIGN_CPU_LIMIT:.0%} other CPU)")
    return (f"HEADLINE: concurrency ({args.layers}x{args.dim} f16, {args.threads} threads, {args.prompt_tokens}+"
            f"{args.tokens} tokens per agent): appliance / llama-server tok/s " + "; ".join(parts))


def report(args: argparse.Namespace, model: Path, prompts: Sequence[AgentPrompt], paths: list[PathSpec],
           results: dict[str, dict[str, Any]], rounds: dict[str, dict[str, Any]],
           ceiling: list[dict[str, float | int]] | None, notes: dict[str, str], flash_resolved: dict[str, str],
           wall_s: float, load: dict[str, float]) -> dict[str, Any]:
    compared = comparisons(results, args.agents)
    targets = target_rows(compared)
    same = same_settings(results, flash_resolved, args.agents)
    complete = all(entry["tokens_complete"] for path in paths if path.strict
                   for entry in results[path.name].values())
    return {
        "benchmark": NAME, "quick": args.quick,
        "model": {"file": model.name, "layers": args.layers, "dim": args.dim, "dtype": "f16"},
        "threads": args.threads, "agents": list(args.agents), "rounds": args.rounds, "max_reruns": args.max_reruns,
        "foreign_cpu_limit": FOREIGN_CPU_LIMIT, "prompt_tokens": args.prompt_tokens, "tokens": args.tokens,
        "appliance_n_ctx": args.n_ctx, "llama_server_ctx_per_slot": args.prompt_tokens + args.tokens + 64,
        "wall_s": wall_s, "box_load": load, "rounds_by_agents": rounds,
        "paths": {path.name: {"label": path.label, "kind": path.kind, "flash_attention": path.flash_attention,
                              "strict": path.strict, "by_agents": results[path.name]}
                  for path in paths},
        "llama_batched_bench": ceiling, "llama_server_flash_attention": flash_resolved, "notes": notes,
        "comparisons": compared, "same_settings": same, "targets": targets,
        "meets_targets": {row["key"]: row["met"] for row in targets}, "tokens_complete": complete,
        "texts_match_solo": texts_match_solo(results),
        "solo_texts": [p.solo for p in prompts], "prompts": [p.text for p in prompts],
        "machine": machine(),
        "units": "tokens_per_s = all streamed tokens / (last token - first request sent), all agents at once, the "
                 "median of the kept rounds; ttft = first streamed text - request sent, per agent (client side); "
                 "peak_rss_bytes = VmHWM of the server process; comparisons = appliance / llama-server "
                 "(adaptive_vs_fixed_*: the appliance on defaults / with engine.adaptive: false); "
                 "same_settings = defaults / flash on of one kind of server when both ran flash attention (an A/A "
                 "pair: the run's noise); "
                 "flash_attention null = the server's own default; context_after_rounds = the appliance's live "
                 "context after the last round (its /v1/health: pool_cells, kv_streams; 0 streams = one pool); "
                 "llama_batched_bench gen_tok_s = generation tokens/s of all sequences together, a KV stream per "
                 "sequence (-no-kvu), gen_tok_s_unified = the same in one unified KV buffer (-kvu), "
                 "unified_over_split = the median of the rounds' ratios (the two layouts one after the other in each "
                 "round)",
        "headline": headline(args, results, compared, notes, rounds, targets, same),
    }


def context_words(context: dict[str, int] | None) -> str:
    """An appliance context as :func:`appliance_context` read it, in a few words."""
    if context is None:
        return "none"
    if context["kv_streams"]:
        return f"{context['kv_streams']} KV streams of {context['pool_cells'] // context['kv_streams']} cells"
    return f"one pool of {context['pool_cells']} cells"


def met_word(met: bool | None) -> str:
    return "absent" if met is None else ("met" if met else "not met")


def print_table(r: dict[str, Any]) -> None:
    print(f"model {r['model']['file']}, {r['threads']} threads, {r['prompt_tokens']}-token prompts, {r['tokens']} "
          f"streamed tokens per agent, all agents at once; tok/s: median of the kept rounds (range)")
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
    for name, logged in r["llama_server_flash_attention"].items():
        print(f"{name}: flash attention as llama.cpp logs it (a probe at --log-verbosity 4): {logged}")
    for name, path in r["paths"].items():
        if path["kind"] == "appliance":
            row = ", ".join(f"N={n} {context_words(e['context_after_rounds'])}" for n, e in path["by_agents"].items())
            print(f"{name}: live context after the rounds: {row}")
    if r["llama_batched_bench"] is not None:
        bench = r["llama_batched_bench"]
        row = ", ".join(f"{b['n_parallel']}: {b['gen_tok_s']:.1f}" for b in bench)
        print(f"llama-batched-bench generation tok/s by sequences, a KV stream per sequence (the box's ceiling): "
              f"{row}")
        row = ", ".join(f"{b['n_parallel']}: {b['gen_tok_s_unified']:.1f} ({b['unified_over_split']:.2f}x)"
                        for b in bench)
        print(f"the same with one unified KV buffer (unified / split): {row}")
    def times(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    for n, c in r["comparisons"].items():
        cells = ", ".join(f"{k} {times(v)}" for k, v in c.items() if not k.startswith("adaptive_vs_fixed"))
        print(f"N={n}: appliance / llama-server {cells}")
        print(f"N={n}: adaptive / fixed tok/s {times(c.get('adaptive_vs_fixed_tok_s'))}, TTFT P99 "
              f"{times(c.get('adaptive_vs_fixed_ttft_p99'))}")
    for kind, cells_by_n in r["same_settings"].items():
        cells = ", ".join(f"N={n} tok/s {times(c['tok_s'])}, TTFT P99 {times(c['ttft_p99'])}"
                          for n, c in cells_by_n.items())
        print(f"A/A, {kind.replace('_', '-')} defaults / flash on (the same settings: this run's noise): {cells}")
    for n, rounds in r["rounds_by_agents"].items():
        shares = ", ".join("-" if rec["foreign_share"] is None else f"{rec['foreign_share']:.0%}"
                           + ("" if rec["kept"] else " dropped") for rec in rounds["records"])
        print(f"N={n}: {rounds['clean']}/{rounds['wanted']} clean rounds in {rounds['attempted']} attempts "
              f"(other processes' CPU per round: {shares})" + (" NOISY" if rounds["noisy"] else ""))
    for what, note in r["notes"].items():
        if note != "measured":
            print(f"{what}: {note}")
    load = r["box_load"]
    print(f"other processes used {load['other_processes_share_of_box']:.0%} of the box's CPU during the whole run")
    print(f"{'target':<52} {'value':>7}  met?")
    for row in r["targets"]:
        value = "-" if row["value"] is None else f"{row['value']:.2f}x"
        print(f"{row['target']:<52} {value:>7}  {met_word(row['met'])}")
    print(f"texts equal to the solo in-process greedy text: {r['texts_match_solo']}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.concurrency", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run (4x256 model, N 1 and 2, 8 tokens)")
    p.add_argument("--agents", type=int, nargs="+", default=None, help="agent counts (default 1 2 4 8; quick 1 2)")
    p.add_argument("--tokens", type=int, default=None, help="streamed tokens per agent (default 64; quick 8)")
    p.add_argument("--prompt-tokens", type=int, default=64, help="prompt tokens per agent, BOS included")
    p.add_argument("--layers", type=int, default=None, help="model layers (default 12; quick 4)")
    p.add_argument("--dim", type=int, default=None, help="model width (default 768; quick 256)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=None,
                   help="clean bursts per path and N, interleaved (default 3; quick 1)")
    p.add_argument("--max-reruns", type=int, default=None,
                   help=f"rounds re-run at most per N when other processes used more than {FOREIGN_CPU_LIMIT:.0%}% "
                        f"of the CPU (default 3; quick 1)")
    p.add_argument("--no-flash-off", dest="flash_off", action="store_false",
                   help="skip the flash-attention-off pair (appliance and llama-server)")
    p.add_argument("--n-ctx", type=int, default=2048, help="the appliance model's n_ctx")
    p.add_argument("--no-peer", action="store_true", help="skip llama-server and llama-batched-bench")
    p.add_argument("--keep-logs", type=Path, default=None, metavar="DIR",
                   help="run the appliances at log level info and keep every server's log in DIR/N<agents>/")
    p.add_argument("--build", action="store_true", help="build the peer first when it is not built")
    p.add_argument("--peer-cache", type=Path, default=None,
                   help="where the peer is built (default ~/.cache/appliance/llama.cpp-<pin>)")
    add_output_args(p, NAME)
    args = p.parse_args(argv)
    fill_defaults(args, full={"agents": [1, 2, 4, 8], "tokens": 64, "layers": 12, "dim": 768, "rounds": 3,
                              "max_reruns": 3},
                  quick={"agents": [1, 2], "tokens": 8, "layers": 4, "dim": 256, "rounds": 1, "max_reruns": 1})
    if min(args.agents) < 1 or min(args.tokens, args.threads, args.rounds) < 1 or args.prompt_tokens < 2:
        p.error("--agents, --tokens, --threads and --rounds must be >= 1, --prompt-tokens >= 2")
    if args.max_reruns < 0:
        p.error("--max-reruns must be >= 0")
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
