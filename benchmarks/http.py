"""HTTP overhead: the appliance's OpenAI API against llama.cpp's own ``llama-server``, both over the same
in-process library call.

One run, one tiny model (4 layers x 256, f16, ``n_ctx`` 2048, the same threads everywhere, flash attention the same
everywhere: ``--flash-attention``, on by default, llama-server's own default on the CPU), the same greedy requests
(temperature 0, two prompts of equal token length alternating, as in ``benchmarks.protocol``) on three paths:

* **in-process** (the baseline): ``Llama.create_completion`` called directly, after ``Llama.reset()`` (it evaluates
  the whole prompt, like a stateless request), on one llama.cpp thread;
* **appliance**: ``python -m appliance run`` (its own process), ``POST /v1/completions`` over one keep-alive
  ``httpx`` connection (SSE when streaming);
* **llama-server**: llama.cpp's server (``-np 1``, its own process; built by ``python -m benchmarks.peer build``,
  ``--build`` builds it first, absent with a note when not built), the same ``POST /v1/completions`` with the same
  body, byte for byte.

Both servers get the raw prompt (no chat template), ``max_tokens``, ``temperature`` 0 and
``stream_options.include_usage``; each answer's prompt tokens, completion tokens and text must equal the in-process
call's (so each server honoured the request as sent; exit 1 otherwise).

Rounds: in each, every path in a fresh random order runs 1 untimed and 5 timed 1-token requests (the per-request
cost, nearly no decoding), one ``--tokens``-token request and the same streamed. A round during which other
processes used more than 10 % of the box's CPU (``/proc/stat`` less this process's and the servers'
``/proc/<pid>/stat`` ticks) is dropped and re-run, up to ``--max-reruns`` times; with fewer clean rounds than
``--rounds`` the HEADLINE says NOISY. Overhead = the median over kept rounds of (the path's round median - the
in-process round median). Then ``/v1/health`` latency on the appliance, idle and while ``--load-streams`` (8)
streaming chat completions run on it.

Targets: the appliance's 1-token overhead at most llama-server's; its ``--tokens``-token streaming tokens/s at least
0.95x llama-server's; ``/v1/health`` median under 5 ms under load.

Run ``python -m benchmarks.http`` (``--quick`` for a seconds-long smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx
import llama_cpp

from benchmarks import peer
from benchmarks.common import (
    FOREIGN_CPU_LIMIT,
    add_output_args,
    default_threads,
    fill_defaults,
    finish,
    machine,
    run_clean_rounds,
    tiny_model,
)
from benchmarks.concurrency import concurrency_config
from benchmarks.protocol.inprocess import ComputeThread
from benchmarks.protocol.measure import SETTLE_S, ms, quantiles_ms
from benchmarks.protocol.servers import Process, free_port
from benchmarks.protocol.workload import MODEL_NAME, PROMPTS, Contender, Sample

NAME = "http"
TARGET_HEALTH_MS = 5.0
TARGET_STREAM_RATIO = 0.95
"""The appliance streams at least this times llama-server's tokens/s."""
BLOCK = 5  # timed 1-token requests per path per round
KINDS = ("one", "request", "stream")
BASE = "in_process"
PEER = "llama_server"


def completion_body(prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    """The OpenAI ``/v1/completions`` body both servers get, byte for byte: the raw prompt, greedy."""
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


class HttpContender(Contender):
    """A path of this benchmark: ``complete`` (``n`` tokens, not streamed) and ``stream``; ``prompt_tokens`` holds
    the prompt token counts its answers reported, per prompt."""

    prompt_tokens: dict[str, set[int]]

    def complete(self, prompt: str, n: int) -> Sample:
        raise NotImplementedError


class InProcess(HttpContender):
    """llama-cpp-python called directly on the compute thread, after ``reset`` (the whole prompt evaluated)."""

    name, label, kind = BASE, "llama-cpp-python Llama.create_completion (in-process)", "in-process"

    def __init__(self, compute: ComputeThread, llm: llama_cpp.Llama) -> None:
        self.compute, self.llm = compute, llm
        self.prompt_tokens: dict[str, set[int]] = {}

    def _complete(self, prompt: str, n: int) -> Sample:
        self.llm.reset()
        start = time.perf_counter()
        r = self.llm.create_completion(prompt, max_tokens=n, temperature=0.0)
        elapsed = time.perf_counter() - start
        self.prompt_tokens.setdefault(prompt, set()).add(r["usage"]["prompt_tokens"])
        return Sample(elapsed, r["choices"][0]["text"], r["usage"]["completion_tokens"])

    def _stream(self, prompt: str, n: int) -> Sample:
        self.llm.reset()
        parts: list[str] = []
        ttft = None
        start = time.perf_counter()
        for chunk in self.llm.create_completion(prompt, max_tokens=n, temperature=0.0, stream=True):
            choice = chunk["choices"][0]
            if choice["finish_reason"] is not None and not choice["text"]:
                continue
            if ttft is None:
                ttft = time.perf_counter() - start
            parts.append(choice["text"])
        return Sample(time.perf_counter() - start, "".join(parts), len(parts), ttft)

    def complete(self, prompt: str, n: int) -> Sample:
        return self.compute.call(self._complete, prompt, n)

    def stream(self, prompt: str, n: int) -> Sample:
        return self.compute.call(self._stream, prompt, n)

    def close(self) -> None:
        self.compute.call(self.llm.close)


class OpenAIServer(HttpContender):
    """``POST /v1/completions`` on an OpenAI-compatible server over one keep-alive connection. A streamed answer's
    tokens are counted from its ``usage`` chunk (a server may send several tokens in one chunk), else one per
    chunk; the prompt tokens every answer reports are kept per prompt."""

    kind = "http"

    def __init__(self, name: str, label: str, base_url: str, pid: int) -> None:
        self.name, self.label, self.pid = name, label, pid
        self.http = httpx.Client(base_url=base_url, timeout=120)
        self.prompt_tokens: dict[str, set[int]] = {}

    def complete(self, prompt: str, n: int) -> Sample:
        start = time.perf_counter()
        r = self.http.post("/v1/completions", json=completion_body(prompt, n, False))
        elapsed = time.perf_counter() - start
        if r.status_code != 200:
            raise RuntimeError(f"{self.label}: HTTP {r.status_code} {' '.join(r.text.split())[:300]}")
        doc = r.json()
        self.prompt_tokens.setdefault(prompt, set()).add(doc["usage"]["prompt_tokens"])
        return Sample(elapsed, doc["choices"][0]["text"], doc["usage"]["completion_tokens"])

    def stream(self, prompt: str, n: int) -> Sample:
        parts: list[str] = []
        ttft = None
        usage: int | None = None
        start = time.perf_counter()
        with self.http.stream("POST", "/v1/completions", json=completion_body(prompt, n, True)) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"{self.label}: HTTP {r.status_code} {' '.join(r.text.split())[:300]}")
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                    self.prompt_tokens.setdefault(prompt, set()).add(chunk["usage"]["prompt_tokens"])
                if not chunk.get("choices"):
                    continue  # the usage chunk
                text = chunk["choices"][0].get("text") or ""
                if not text:
                    continue  # a chunk that only carries finish_reason
                if ttft is None:
                    ttft = time.perf_counter() - start
                parts.append(text)
        elapsed = time.perf_counter() - start
        return Sample(elapsed, "".join(parts), len(parts) if usage is None else usage, ttft)

    def close(self) -> None:
        self.http.close()


Taken = dict[str, dict[str, dict[int, list[Sample]]]]
"""Timed samples by kind, path name and round (attempt)."""
Texts = dict[str, dict[str, dict[int, set[str]]]]
"""Every text by kind, path name and prompt index (warm-up and dropped rounds included)."""


def run_path_turn(path: HttpContender, attempt: int, tokens: int, taken: Taken, texts: Texts) -> None:
    """One path's turn in a round: 1 untimed and :data:`BLOCK` timed 1-token requests, one ``tokens``-token request
    and the same streamed. Prompts alternate request by request, so no timed request follows its own prompt (no
    prefix-cache hit past BOS)."""
    time.sleep(SETTLE_S)
    calls = [("one", 1, i > 0) for i in range(1 + BLOCK)] + [("request", tokens, True), ("stream", tokens, True)]
    for i, (kind, n, timed) in enumerate(calls):
        prompt = (attempt + i) % len(PROMPTS)
        sample = path.stream(PROMPTS[prompt], n) if kind == "stream" else path.complete(PROMPTS[prompt], n)
        texts[kind][path.name].setdefault(prompt, set()).add(sample.text)
        if timed:
            taken[kind][path.name].setdefault(attempt, []).append(sample)


def measure(paths: list[HttpContender], args: argparse.Namespace,
            pids: Callable[[], Sequence[int]]) -> tuple[Taken, Texts, dict[str, Any]]:
    """Warm-up, then clean rounds (:func:`~benchmarks.common.run_clean_rounds`): the timed samples, every text, and
    the rounds' record."""
    taken: Taken = {k: {p.name: {} for p in paths} for k in KINDS}
    texts: Texts = {k: {p.name: {} for p in paths} for k in KINDS}
    for path in paths:
        for i in range(args.warmup):
            prompt = i % len(PROMPTS)
            texts["one"][path.name].setdefault(prompt, set()).add(path.complete(PROMPTS[prompt], 1).text)
        texts["request"][path.name].setdefault(0, set()).add(path.complete(PROMPTS[0], args.tokens).text)
    rng = random.Random(0)

    def one_round(attempt: int) -> None:
        order = list(paths)
        rng.shuffle(order)
        for path in order:
            run_path_turn(path, attempt, args.tokens, taken, texts)

    rounds = run_clean_rounds(args.rounds, args.max_reruns, one_round, pids)
    return taken, texts, rounds


def paired_overhead_ms(path: dict[int, list[Sample]], base: dict[int, list[Sample]], kept: Sequence[int]) -> float:
    """The median, over the kept rounds, of (the path's median - the in-process median) in that round: each round's
    turns run within a second of each other, so a load that comes and goes on a shared machine cancels out."""
    differences = [statistics.median(s.elapsed_s for s in path[a]) - statistics.median(s.elapsed_s for s in base[a])
                   for a in kept]
    return ms(statistics.median(differences))


def summarize(paths: list[HttpContender], taken: Taken, texts: Texts, kept: Sequence[int],
              args: argparse.Namespace) -> dict[str, Any]:
    """Each path's medians over the kept rounds, its overhead over the in-process call and its tokens/s; its texts
    and prompt tokens against the library's (the same per prompt, for 1 token and for the full request, streamed or
    not)."""
    out: dict[str, Any] = {}
    base_tokens = next(p for p in paths if p.name == BASE).prompt_tokens
    for path in paths:
        name = path.name
        entry: dict[str, Any] = {"label": path.label, "kind": path.kind}
        for kind in KINDS:
            samples = [s for a in kept for s in taken[kind][name][a]]
            entry[kind] = {**quantiles_ms([s.elapsed_s for s in samples]), "n": len(samples),
                           "completion_tokens": sorted({s.tokens for s in samples})}
        ttft = [s.ttft_s for a in kept for s in taken["stream"][name][a] if s.ttft_s is not None]
        entry["stream"]["ttft_median_ms"] = ms(statistics.median(ttft)) if ttft else None
        entry["stream"]["tokens_per_s"] = args.tokens / (entry["stream"]["median_ms"] / 1e3)
        entry["text_matches_in_process"] = all(
            texts[kind][name] == texts[kind][BASE] and all(len(v) == 1 for v in texts[kind][BASE].values())
            for kind in KINDS)
        prompt_tokens = path.prompt_tokens
        entry["prompt_tokens"] = {prompt: sorted(counts) for prompt, counts in prompt_tokens.items()}
        entry["prompt_tokens_match_in_process"] = prompt_tokens == base_tokens and all(
            len(counts) == 1 for counts in base_tokens.values())
        entry["texts"] = {kind: {PROMPTS[i]: sorted(t) for i, t in sorted(texts[kind][name].items())}
                          for kind in KINDS}
        out[name] = entry
    for name, entry in out.items():
        for kind in ("one", "request"):
            entry[kind]["overhead_ms"] = entry[kind]["median_ms"] - out[BASE][kind]["median_ms"]
            entry[kind]["paired_overhead_ms"] = paired_overhead_ms(taken[kind][name], taken[kind][BASE], kept)
        entry["stream"]["tokens_per_s_ratio"] = entry["stream"]["tokens_per_s"] / out[BASE]["stream"]["tokens_per_s"]
    return out


def chat_stream(base_url: str, tokens: int, stop: threading.Event, counts: list[int], index: int) -> None:
    """One load client: streaming chat completions back to back until ``stop``; counts the chunks it got."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPTS[index % len(PROMPTS)]}],
            "max_tokens": tokens, "temperature": 0.0, "stream": True}
    with httpx.Client(base_url=base_url, timeout=120) as http:
        while not stop.is_set():
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                r.raise_for_status()
                for line in r.iter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        counts[index] += 1
                    if stop.is_set():
                        break


def health_latency(base_url: str, probes: int, pause_s: float) -> list[float]:
    """``probes`` sequential ``GET /v1/health`` on one keep-alive connection, ``pause_s`` apart: seconds each."""
    taken: list[float] = []
    with httpx.Client(base_url=base_url, timeout=30) as http:
        for _ in range(probes):
            start = time.perf_counter()
            r = http.get("/v1/health")
            taken.append(time.perf_counter() - start)
            r.raise_for_status()
            time.sleep(pause_s)
    return taken


def health_under_load(base_url: str, args: argparse.Namespace) -> dict[str, Any]:
    """``/v1/health`` idle, then while ``args.load_streams`` streaming chats run (each restarted as it ends)."""
    idle = health_latency(base_url, args.health_probes, 0.005)
    stop = threading.Event()
    counts = [0] * args.load_streams
    failures: list[BaseException] = []

    def client(index: int) -> None:
        try:
            chat_stream(base_url, args.load_tokens, stop, counts, index)
        except BaseException as exc:  # reported in the result, the run goes on
            failures.append(exc)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(args.load_streams)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while min(counts) == 0 and time.monotonic() < deadline and not failures:  # every stream is under way
        time.sleep(0.05)
    started = sum(counts)
    start = time.perf_counter()
    loaded = health_latency(base_url, args.health_probes, 0.01)
    wall = time.perf_counter() - start
    chunks = sum(counts) - started
    stop.set()
    for thread in threads:
        thread.join(120)
    return {"idle": quantiles_ms(idle), "under_load": quantiles_ms(loaded), "probes": args.health_probes,
            "load_streams": args.load_streams, "load_tokens_per_stream": args.load_tokens,
            "streams_all_running": min(counts) > 0, "load_chunks_during_probes": chunks,
            "load_chunks_per_s": chunks / wall if wall > 0 else 0.0,
            "load_failures": [f"{type(exc).__name__}: {exc}" for exc in failures]}


def wait_for_openai(base_url: str, proc: Process) -> str | None:
    """None once the appliance answers ``POST /v1/completions``; else why not."""
    def ready() -> bool:
        return httpx.get(base_url + "/v1/health", timeout=2).status_code == 200

    proc.wait_until(ready, "the appliance")
    try:
        r = httpx.post(base_url + "/v1/completions", json=completion_body(PROMPTS[0], 1, False), timeout=60)
    except httpx.HTTPError as exc:
        return f"the appliance did not answer POST /v1/completions ({exc})"
    if r.status_code == 200 and "choices" in r.text:
        return None
    return f"the appliance has no working /v1/completions (HTTP {r.status_code} {' '.join(r.text.split())[:160]})"


def close_quietly(path: HttpContender) -> None:
    """Close a path at the end of a run; a path that fails to close does not hide the run's result or error."""
    with contextlib.suppress(Exception):
        path.close()


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model(args.model_dir, layers=args.layers, dim=args.dim)
    flash = args.flash_attention == "on"
    n_batch = min(512, args.n_ctx)
    paths: list[HttpContender] = []
    notes: dict[str, str] = {}
    health: dict[str, Any] | None = None
    flash_logged: str | None = None
    binaries, notes[PEER] = peer.binaries_or_why(args.no_peer, args.build, args.peer_cache)
    with contextlib.ExitStack() as stack:  # closed in reverse: paths, library, servers, then the state folder
        state = Path(tempfile.mkdtemp(prefix="ap-http-"))  # short: AF_UNIX paths are limited to 108 bytes
        stack.callback(shutil.rmtree, state, True)
        http_port = free_port()
        engine: dict[str, int | bool] = {"threads": args.threads, "flash_attention": flash}
        (state / "appliance.yaml").write_text(concurrency_config(model, state, n_ctx=args.n_ctx, http_port=http_port,
                                                                 engine=engine))
        appliance = Process([sys.executable, "-m", "appliance", "--log-level", "warning", "run", "--config",
                             str(state / "appliance.yaml")], state / "appliance.log")
        stack.callback(appliance.stop)
        server: peer.LlamaServer | None = None
        if binaries is not None:
            server = stack.enter_context(peer.LlamaServer(
                binaries["llama-server"], model, n_parallel=1, threads=args.threads, n_ctx=args.n_ctx,
                log=state / "llama-server.log", flash_attention=flash))
            flash_logged = peer.probe_flash_attention(binaries["llama-server"], model, args.threads, flash)
        compute = ComputeThread(args.threads)
        stack.callback(compute.close)

        def load_library() -> llama_cpp.Llama:
            return llama_cpp.Llama(model_path=str(model), n_ctx=args.n_ctx, n_batch=n_batch, n_threads=args.threads,
                                   n_threads_batch=args.threads, n_gpu_layers=0, seed=0, flash_attn=flash,
                                   verbose=False)

        paths.append(InProcess(compute, compute.call(load_library)))
        base_url = f"http://127.0.0.1:{http_port}"
        appliance_why = wait_for_openai(base_url, appliance)
        if appliance_why is None:
            paths.append(OpenAIServer("appliance", "appliance /v1/completions (httpx keep-alive)", base_url,
                                      appliance.proc.pid))
            notes["appliance"] = "measured"
        else:
            notes["appliance"] = f"absent: {appliance_why}"
        if server is not None:
            paths.append(OpenAIServer(PEER, "llama-server /v1/completions (httpx keep-alive)", server.base_url,
                                      server.pid))
        for path in paths:
            stack.callback(close_quietly, path)
        for what, note in notes.items():
            if note != "measured":
                print(f"note: {what}: {note}", flush=True)

        def server_pids() -> list[int]:
            return [p.pid for p in paths if isinstance(p, OpenAIServer)]

        start = time.perf_counter()
        taken, texts, rounds = measure(paths, args, server_pids)
        if appliance_why is None:
            health = health_under_load(base_url, args)
        wall_s = time.perf_counter() - start
        results = summarize(paths, taken, texts, rounds["kept_attempts"], args)
    return report(args, model, results, rounds, health, notes, flash_logged, wall_s)


def ratio(ours: float | None, theirs: float | None) -> float | None:
    """ours / theirs; None when a side is absent or theirs is not above 0 (an overhead at or below 0 has no
    meaningful ratio)."""
    if ours is None or theirs is None or theirs <= 0:
        return None
    return ours / theirs


def target_rows(results: dict[str, Any], health: dict[str, Any] | None, tokens: int) -> list[dict[str, Any]]:
    """Every target with its figures and whether it is met (None: a side is absent)."""
    ours, theirs = results.get("appliance"), results.get(PEER)
    both = ours is not None and theirs is not None
    one_ours = None if ours is None else ours["one"]["paired_overhead_ms"]
    one_theirs = None if theirs is None else theirs["one"]["paired_overhead_ms"]
    stream_ratio = ratio(None if ours is None else ours["stream"]["tokens_per_s"],
                         None if theirs is None else theirs["stream"]["tokens_per_s"])
    health_ms = None if health is None else health["under_load"]["median_ms"]
    return [
        {"key": "overhead_1_token", "target": "1-token overhead <= llama-server's",
         "value": one_ours, "peer": one_theirs, "ratio": ratio(one_ours, one_theirs),
         "met": None if not both or one_ours is None or one_theirs is None else one_ours <= one_theirs},
        {"key": "stream_tokens_per_s", "target": f"{tokens}-token stream tok/s >= {TARGET_STREAM_RATIO}x "
                                                 f"llama-server's",
         "value": None if ours is None else ours["stream"]["tokens_per_s"],
         "peer": None if theirs is None else theirs["stream"]["tokens_per_s"], "ratio": stream_ratio,
         "met": None if stream_ratio is None else stream_ratio >= TARGET_STREAM_RATIO},
        {"key": "health_under_load", "target": f"/v1/health median under load < {TARGET_HEALTH_MS:.0f} ms",
         "value": health_ms, "peer": None, "ratio": None,
         "met": None if health_ms is None else health_ms < TARGET_HEALTH_MS},
    ]


def headline(args: argparse.Namespace, results: dict[str, Any], health: dict[str, Any] | None,
             notes: dict[str, str], rounds: dict[str, Any], targets: list[dict[str, Any]], correct: bool) -> str:
    def fmt(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f}x"

    base = results[BASE]
    parts = [f"in-process {base['one']['median_ms']:.2f} ms (1 token) / {base['request']['median_ms']:.1f} ms "
             f"({args.tokens} tokens)"]
    for name, label in (("appliance", "appliance"), (PEER, "llama-server")):
        entry = results.get(name)
        if entry is None:
            parts.append(f"{label} {notes[name].split(';')[0]}")
            continue
        parts.append(f"{label} {entry['one']['paired_overhead_ms']:+.2f} ms / "
                     f"{entry['request']['paired_overhead_ms']:+.1f} ms, stream {entry['stream']['tokens_per_s']:.0f} "
                     f"tok/s")
    by_key = {row["key"]: row for row in targets}
    if "appliance" in results and PEER in results:
        parts.append(f"appliance / llama-server: 1-token overhead {fmt(by_key['overhead_1_token']['ratio'])}, "
                     f"stream {fmt(by_key['stream_tokens_per_s']['ratio'])}")
    if health is not None:
        parts.append(f"/v1/health median {health['under_load']['median_ms']:.2f} ms under {health['load_streams']} "
                     f"streams (idle {health['idle']['median_ms']:.2f} ms)")
    known = [row for row in targets if row["met"] is not None]
    parts.append(f"targets met {sum(1 for row in known if row['met'])}/{len(known)}")
    if rounds["noisy"]:
        parts.append(f"NOISY: {rounds['clean']}/{rounds['wanted']} rounds clean in {rounds['attempted']} (other "
                     f"processes over {FOREIGN_CPU_LIMIT:.0%} of the CPU)")
    text = (f"HEADLINE: http overhead (1 token / {args.tokens} tokens, flash attention {args.flash_attention} "
            f"everywhere): " + "; ".join(parts))
    return text if correct else text + "; texts DIFFER"


def report(args: argparse.Namespace, model: Path, results: dict[str, Any], rounds: dict[str, Any],
           health: dict[str, Any] | None, notes: dict[str, str], flash_logged: str | None,
           wall_s: float) -> dict[str, Any]:
    targets = target_rows(results, health, args.tokens)
    correct = all(entry["text_matches_in_process"] and entry["prompt_tokens_match_in_process"]
                  for entry in results.values())
    return {
        "benchmark": NAME, "quick": args.quick,
        "model": {"file": model.name, "layers": args.layers, "dim": args.dim, "dtype": "f16"},
        "n_ctx": args.n_ctx, "threads": args.threads, "flash_attention": args.flash_attention,
        "llama_server_flash_attention_logged": flash_logged, "prompts": list(PROMPTS), "tokens": args.tokens,
        "block": BLOCK, "rounds": rounds, "warmup": args.warmup, "wall_s": wall_s,
        "paths": results, "notes": notes, "health": health, "targets": targets,
        "meets_targets": {row["key"]: row["met"] for row in targets}, "texts_match": correct, "machine": machine(),
        "units": "ms are medians over the kept rounds; overhead_ms = median(path) - median(in-process); "
                 "paired_overhead_ms = median over kept rounds of (path's round median - in-process round median), "
                 "what the targets and the HEADLINE use; tokens_per_s = tokens / median stream time (request sent "
                 "to last chunk); ratios = appliance / llama-server",
        "headline": headline(args, results, health, notes, rounds, targets, correct),
    }


def met_word(met: bool | None) -> str:
    return "absent" if met is None else ("met" if met else "not met")


def print_table(r: dict[str, Any]) -> None:
    rounds = r["rounds"]
    print(f"model {r['model']['file']}, n_ctx {r['n_ctx']}, {r['threads']} threads, flash attention "
          f"{r['flash_attention']} everywhere (llama-server's log: {r['llama_server_flash_attention_logged']}); "
          f"medians of {len(rounds['kept_attempts'])} kept rounds of {r['block']} 1-token requests, one "
          f"{r['tokens']}-token request and one stream per path, interleaved")
    print(f"{'path':<14} {'1-tok ms':>9} {'+ms':>7} {'paired':>7} {'req ms':>8} {'+ms':>7} {'paired':>7} "
          f"{'stream ms':>10} {'tok/s':>7} {'ratio':>6} {'ttft ms':>8} text")
    for name, p in r["paths"].items():
        ttft = p["stream"]["ttft_median_ms"]
        ok = p["text_matches_in_process"] and p["prompt_tokens_match_in_process"]
        print(f"{name:<14} {p['one']['median_ms']:>9.2f} {p['one']['overhead_ms']:>+7.2f} "
              f"{p['one']['paired_overhead_ms']:>+7.2f} {p['request']['median_ms']:>8.2f} "
              f"{p['request']['overhead_ms']:>+7.2f} {p['request']['paired_overhead_ms']:>+7.2f} "
              f"{p['stream']['median_ms']:>10.2f} {p['stream']['tokens_per_s']:>7.0f} "
              f"{p['stream']['tokens_per_s_ratio']:>6.2f} {'-' if ttft is None else f'{ttft:.2f}':>8} "
              f"{'ok' if ok else 'DIFFERS'}")
    health = r["health"]
    if health is not None:
        print(f"/v1/health: idle median {health['idle']['median_ms']:.2f} ms; under {health['load_streams']} "
              f"streaming chats median {health['under_load']['median_ms']:.2f} ms, p90 "
              f"{health['under_load']['p90_ms']:.2f} ms ({health['load_chunks_per_s']:.0f} chunks/s streamed "
              f"meanwhile)")
    shares = ", ".join("-" if rec["foreign_share"] is None else f"{rec['foreign_share']:.0%}"
                       + ("" if rec["kept"] else " dropped") for rec in rounds["records"])
    print(f"{rounds['clean']}/{rounds['wanted']} clean rounds in {rounds['attempted']} attempts (other processes' CPU "
          f"per round: {shares})" + (" NOISY" if rounds["noisy"] else ""))
    for what, note in r["notes"].items():
        if note != "measured":
            print(f"{what}: {note}")
    print(f"{'target':<46} {'appliance':>10} {'llama-server':>13} {'ratio':>6}  met?")
    for row in r["targets"]:
        value = "-" if row["value"] is None else f"{row['value']:.2f}"
        theirs = "-" if row["peer"] is None else f"{row['peer']:.2f}"
        share = "-" if row["ratio"] is None else f"{row['ratio']:.2f}x"
        print(f"{row['target']:<46} {value:>10} {theirs:>13} {share:>6}  {met_word(row['met'])}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.http", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"clean rounds (each: {BLOCK} 1-token requests, one request and one stream per path; "
                        f"default 20, quick 2)")
    p.add_argument("--max-reruns", type=int, default=None,
                   help=f"rounds re-run at most when other processes used more than {FOREIGN_CPU_LIMIT:.0%}% of the "
                        f"CPU (default 10; quick 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed 1-token requests per path first (default 10)")
    p.add_argument("--tokens", type=int, default=32, help="tokens of the full request and of the stream")
    p.add_argument("--flash-attention", choices=("on", "off"), default="on",
                   help="flash attention of every path (default on: llama-server's own default on the CPU)")
    p.add_argument("--load-streams", type=int, default=8, help="streaming chats running during the health probes")
    p.add_argument("--load-tokens", type=int, default=None, help="tokens per load chat (default 256; quick 32)")
    p.add_argument("--health-probes", type=int, default=None, help="GET /v1/health per phase (default 200)")
    p.add_argument("--no-peer", action="store_true", help="skip llama-server")
    p.add_argument("--build", action="store_true", help="build llama-server first when it is not built")
    p.add_argument("--peer-cache", type=Path, default=None,
                   help="where llama-server is built (default ~/.cache/appliance/llama.cpp-<pin>)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--threads", type=int, default=default_threads())
    add_output_args(p, NAME)
    args = p.parse_args(argv)
    fill_defaults(args, full={"rounds": 20, "max_reruns": 10, "warmup": 10, "load_tokens": 256,
                              "health_probes": 200},
                  quick={"rounds": 2, "max_reruns": 1, "warmup": 2, "load_tokens": 32, "health_probes": 20})
    if min(args.rounds, args.warmup, args.load_streams, args.health_probes) < 1 or args.tokens < 2:
        p.error("counts must be >= 1 and --tokens >= 2")
    if args.max_reruns < 0:
        p.error("--max-reruns must be >= 0")
    if args.no_peer and args.build:
        p.error("--build and --no-peer contradict each other")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    return finish(result, args.out, print_table, ok=result["texts_match"])


if __name__ == "__main__":
    raise SystemExit(main())
