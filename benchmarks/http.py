"""HTTP overhead: the appliance's OpenAI API against llama-cpp-python's own OpenAI server (SPEC W2, B4).

One run, one tiny model (4 layers x 256, f16, ``n_ctx`` 2048, the same threads everywhere), the same greedy
requests (temperature 0, two prompts of equal token length alternating, as in ``benchmarks.protocol``) on three
paths:

* **in-process** (the baseline): ``Llama.create_completion`` called directly, after ``Llama.reset()`` (it evaluates
  the whole prompt, like the appliance's stateless request), on one llama.cpp thread;
* **appliance**: ``python -m appliance run`` (its own process), ``POST /v1/completions`` over one keep-alive
  ``httpx`` connection (SSE when streaming);
* **llama_cpp.server**: llama-cpp-python's bundled OpenAI server (its own process), the same requests.

Per path: a 1-token request (the per-request cost, nearly no decoding), the full request (``--tokens`` tokens,
non-streaming) and the same streamed; interleaved rounds in a fresh random order, medians. Overhead = median(path)
- median(in-process). Then ``/v1/health`` latency on the appliance, idle and while ``--load-streams`` (8) streaming
chat completions run on it. Every path's texts must equal the in-process library's (exit 1 otherwise).

Targets: the appliance's overhead at most half of ``llama_cpp.server``'s; ``/v1/health`` median under 5 ms under
load. ``llama_cpp.server`` needs its extras (``pip install fastapi sse-starlette starlette-context
pydantic-settings``); without them (or with ``--no-llama-server``) its path is skipped and the run says so.

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

from benchmarks.common import (
    ContextThreads,
    add_output_args,
    default_threads,
    fill_defaults,
    finish,
    machine,
    tiny_model,
)
from benchmarks.protocol.inprocess import ComputeThread
from benchmarks.protocol.measure import ms, quantiles_ms, rounds
from benchmarks.protocol.servers import (
    Process,
    appliance_config,
    free_port,
    llama_server_missing,
    start_llama_server,
)
from benchmarks.protocol.workload import MODEL_NAME, PROMPTS, Contender, Sample

NAME = "http"
TARGET_OVERHEAD_SHARE = 0.5
TARGET_HEALTH_MS = 5.0
BLOCK = 5  # 1-token requests per path per round
LLAMA_SERVER_EXTRA = {"repeat_penalty": 1.0}
"""llama_cpp.server defaults ``repeat_penalty`` to 1.1 (the library to 1.0): it is asked for the library's greedy
request. The appliance takes OpenAI's fields only (it refuses unknown ones) and has no repeat penalty."""


def completion_body(prompt: str, max_tokens: int, stream: bool) -> dict[str, Any]:
    """The OpenAI ``/v1/completions`` body every server gets (plus its ``extra``)."""
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": stream}


class InProcess(Contender):
    """llama-cpp-python called directly on the compute thread, after ``reset`` (the whole prompt evaluated)."""

    name, label, kind = "in_process", "llama-cpp-python Llama.create_completion (in-process)", "in-process"

    def __init__(self, compute: ComputeThread, llm: llama_cpp.Llama) -> None:
        self.compute, self.llm = compute, llm

    def _complete(self, prompt: str, n: int) -> Sample:
        self.llm.reset()
        start = time.perf_counter()
        r = self.llm.create_completion(prompt, max_tokens=n, temperature=0.0)
        elapsed = time.perf_counter() - start
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


class OpenAIServer(Contender):
    """``POST /v1/completions`` on an OpenAI-compatible server over one keep-alive connection. A server may send
    several tokens in one chunk: with ``stream_usage`` the stream asks for its ``usage`` chunk
    (``stream_options.include_usage``) and counts its tokens from it, else it counts the chunks."""

    kind = "http"

    def __init__(self, name: str, label: str, base_url: str, extra: dict[str, Any], *,
                 stream_usage: bool = False) -> None:
        self.name, self.label, self.extra = name, label, extra
        self.stream_usage = stream_usage
        self.http = httpx.Client(base_url=base_url, timeout=120)

    def complete(self, prompt: str, n: int) -> Sample:
        start = time.perf_counter()
        r = self.http.post("/v1/completions", json={**completion_body(prompt, n, False), **self.extra})
        r.raise_for_status()
        doc = r.json()
        return Sample(time.perf_counter() - start, doc["choices"][0]["text"], doc["usage"]["completion_tokens"])

    def stream(self, prompt: str, n: int) -> Sample:
        parts: list[str] = []
        ttft = None
        usage: int | None = None
        body = {**completion_body(prompt, n, True), **self.extra}
        if self.stream_usage:
            body["stream_options"] = {"include_usage": True}
        start = time.perf_counter()
        with self.http.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue  # the usage chunk
                choice = chunk["choices"][0]
                if choice.get("finish_reason") is not None and not choice.get("text"):
                    continue  # the closing chunk that only carries finish_reason
                if ttft is None:
                    ttft = time.perf_counter() - start
                parts.append(choice.get("text") or "")
        elapsed = time.perf_counter() - start
        return Sample(elapsed, "".join(parts), len(parts) if usage is None else usage, ttft)

    def close(self) -> None:
        self.http.close()


def measure(paths: list[Contender], args: argparse.Namespace) -> dict[str, Any]:
    """Interleaved rounds: 1-token requests, full requests and streams; samples and texts per path and kind."""
    kinds = ("one", "request", "stream")
    samples: dict[str, dict[str, list[Sample]]] = {k: {p.name: [] for p in paths} for k in kinds}
    texts: dict[str, dict[str, dict[int, set[str]]]] = {k: {p.name: {} for p in paths} for k in kinds}

    def recorder(kind: str, warmup: bool = False) -> Callable[[Contender, int, Sample, bool], None]:
        def record(path: Contender, prompt: int, sample: Sample, timed: bool) -> None:
            texts[kind][path.name].setdefault(prompt, set()).add(sample.text)
            if timed and not warmup:
                samples[kind][path.name].append(sample)
        return record

    def one(path: Contender, prompt: str) -> Sample:
        return path.complete(prompt, 1)  # type: ignore[attr-defined, no-any-return]

    def request(path: Contender, prompt: str) -> Sample:
        return path.complete(prompt, args.tokens)  # type: ignore[attr-defined, no-any-return]

    def stream(path: Contender, prompt: str) -> Sample:
        return path.stream(prompt, args.tokens)

    rng = random.Random(0)
    rounds(paths, 1, args.warmup, one, recorder("one", warmup=True), rng)
    rounds(paths, 1, 1, request, recorder("request", warmup=True), rng)
    block = min(BLOCK, args.requests)
    rounds(paths, -(-args.requests // block), block, one, recorder("one"), rng, lead=1)
    rounds(paths, args.streams, 1, request, recorder("request"), rng)
    rounds(paths, args.streams, 1, stream, recorder("stream"), rng)
    return {"samples": samples, "texts": texts}


def summarize(paths: list[Contender], raw: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Each path's medians, its overhead over the in-process call and its tokens/s; its texts against the
    library's (the same text per prompt, for 1 token and for the full request, streamed or not)."""
    base = InProcess.name
    out: dict[str, Any] = {}
    for path in paths:
        name = path.name
        entry: dict[str, Any] = {"label": path.label, "kind": path.kind}
        for kind in ("one", "request", "stream"):
            taken = raw["samples"][kind][name]
            entry[kind] = {**quantiles_ms([s.elapsed_s for s in taken]), "n": len(taken),
                           "completion_tokens": sorted({s.tokens for s in taken})}
        ttft = [s.ttft_s for s in raw["samples"]["stream"][name] if s.ttft_s is not None]
        entry["stream"]["ttft_median_ms"] = ms(statistics.median(ttft)) if ttft else None
        entry["stream"]["tokens_per_s"] = args.tokens / (entry["stream"]["median_ms"] / 1e3)
        texts = raw["texts"]
        entry["text_matches_in_process"] = all(
            texts[kind][name] == texts[kind][base] and all(len(v) == 1 for v in texts[kind][base].values())
            for kind in ("one", "request", "stream"))
        entry["texts"] = {kind: {PROMPTS[i]: sorted(t) for i, t in sorted(texts[kind][name].items())}
                          for kind in ("one", "request", "stream")}
        out[name] = entry
    block = min(BLOCK, args.requests)
    for name, entry in out.items():
        for kind, size in (("one", block), ("request", 1)):
            entry[kind]["overhead_ms"] = entry[kind]["median_ms"] - out[base][kind]["median_ms"]
            entry[kind]["paired_overhead_ms"] = paired_overhead_ms(raw["samples"][kind][name],
                                                                   raw["samples"][kind][base], size)
        entry["stream"]["tokens_per_s_ratio"] = entry["stream"]["tokens_per_s"] / out[base]["stream"]["tokens_per_s"]
    return out


def paired_overhead_ms(path: Sequence[Sample], base: Sequence[Sample], size: int) -> float:
    """The median, over the rounds, of (the path's median - the in-process median) in that round: each round's
    turns run within a second of each other, so a load that comes and goes on a shared machine cancels out."""
    differences = []
    for start in range(0, min(len(path), len(base)), size):
        ours = statistics.median(s.elapsed_s for s in path[start:start + size])
        theirs = statistics.median(s.elapsed_s for s in base[start:start + size])
        differences.append(ours - theirs)
    return ms(statistics.median(differences))


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
        body = {**completion_body(PROMPTS[0], 1, False), "model": MODEL_NAME}
        r = httpx.post(base_url + "/v1/completions", json=body, timeout=60)
    except httpx.HTTPError as exc:
        return f"the appliance did not answer POST /v1/completions ({exc})"
    if r.status_code == 200 and "choices" in r.text:
        return None
    return f"the appliance has no working /v1/completions (HTTP {r.status_code} {' '.join(r.text.split())[:160]})"


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model(args.model_dir, layers=args.layers, dim=args.dim)
    n_batch = min(512, args.n_ctx)
    state = Path(tempfile.mkdtemp(prefix="ap-http-"))  # short: AF_UNIX paths are limited to 108 bytes
    procs: list[Process] = []
    paths: list[Contender] = []
    compute: ComputeThread | None = None
    notes: dict[str, str] = {}
    health: dict[str, Any] | None = None
    try:
        http_port = free_port()
        config_text = appliance_config(model, state, n_ctx=args.n_ctx, threads=args.threads, http_port=http_port)
        (state / "appliance.yaml").write_text(config_text)
        appliance = Process([sys.executable, "-m", "appliance", "--log-level", "warning", "run", "--config",
                             str(state / "appliance.yaml")], state / "appliance.log")
        procs.append(appliance)
        compute = ComputeThread(args.threads)
        params = ContextThreads(args.threads, args.threads)  # the library and llama_cpp.server: the engine's threads
        llm = compute.call(lambda: llama_cpp.Llama(
            model_path=str(model), n_ctx=args.n_ctx, n_batch=n_batch, n_threads=params.n_threads,
            n_threads_batch=params.n_threads_batch, n_gpu_layers=0, seed=0, verbose=False))
        paths.append(InProcess(compute, llm))
        server_why = "--no-llama-server was given" if args.no_llama_server else llama_server_missing()
        if server_why is None:
            port = free_port()
            procs.append(start_llama_server(model, port, params, args.n_ctx, n_batch, state / "llama_server.log"))
        base_url = f"http://127.0.0.1:{http_port}"
        appliance_why = wait_for_openai(base_url, appliance)
        if appliance_why is None:
            paths.append(OpenAIServer("appliance", "appliance /v1/completions (httpx keep-alive)", base_url,
                                      {"model": MODEL_NAME}, stream_usage=True))
            notes["appliance"] = "measured"
        else:
            notes["appliance"] = f"skipped: {appliance_why}"
        if server_why is None:
            paths.append(OpenAIServer("llama_cpp_server", "llama_cpp.server /v1/completions (httpx keep-alive)",
                                      f"http://127.0.0.1:{port}", LLAMA_SERVER_EXTRA))
            notes["llama_cpp_server"] = "measured"
        else:
            notes["llama_cpp_server"] = f"skipped: {server_why}"
        for what, note in notes.items():
            if note != "measured":
                print(f"note: {what}: {note}", flush=True)
        start = time.perf_counter()
        raw = measure(paths, args)
        if appliance_why is None:
            health = health_under_load(base_url, args)
        wall_s = time.perf_counter() - start
        results = summarize(paths, raw, args)
    finally:
        for path in paths:
            with contextlib.suppress(Exception):
                path.close()
        if compute is not None:
            compute.close()
        for proc in procs:
            proc.stop()
        shutil.rmtree(state, ignore_errors=True)
    return report(args, model, results, health, notes, wall_s)


def report(args: argparse.Namespace, model: Path, results: dict[str, Any], health: dict[str, Any] | None,
           notes: dict[str, str], wall_s: float) -> dict[str, Any]:
    ours, theirs = results.get("appliance"), results.get("llama_cpp_server")
    base = results[InProcess.name]
    meets: dict[str, bool | None] = {"overhead_1_token": None, "overhead_request": None, "health_under_load": None}
    parts = [f"in-process {base['one']['median_ms']:.2f} ms (1 token) / {base['request']['median_ms']:.1f} ms "
             f"({args.tokens} tokens)"]
    for name, entry in (("appliance", ours), ("llama_cpp.server", theirs)):
        if entry is None:
            parts.append(f"{name} skipped")
            continue
        parts.append(f"{name} {entry['one']['paired_overhead_ms']:+.2f} ms / "
                     f"{entry['request']['paired_overhead_ms']:+.1f} ms, "
                     f"stream {entry['stream']['tokens_per_s']:.0f} tok/s "
                     f"({entry['stream']['tokens_per_s_ratio']:.2f}x)")
    if ours is not None and theirs is not None:
        for kind, key in (("one", "overhead_1_token"), ("request", "overhead_request")):
            limit = TARGET_OVERHEAD_SHARE * theirs[kind]["paired_overhead_ms"]
            meets[key] = ours[kind]["paired_overhead_ms"] <= limit
    if health is not None:
        meets["health_under_load"] = health["under_load"]["median_ms"] < TARGET_HEALTH_MS
        parts.append(f"/v1/health median {health['under_load']['median_ms']:.2f} ms under {health['load_streams']} "
                     f"streams (idle {health['idle']['median_ms']:.2f} ms)")
    correct = all(entry["text_matches_in_process"] for entry in results.values())
    headline = f"HEADLINE: http overhead (1 token / {args.tokens} tokens): " + "; ".join(parts)
    headline += "" if correct else "; texts DIFFER"
    return {
        "benchmark": NAME, "quick": args.quick,
        "model": {"file": model.name, "layers": args.layers, "dim": args.dim, "dtype": "f16"},
        "n_ctx": args.n_ctx, "threads": args.threads, "prompts": list(PROMPTS), "tokens": args.tokens,
        "requests": args.requests, "streams": args.streams, "warmup": args.warmup, "wall_s": wall_s,
        "paths": results, "notes": notes, "health": health,
        "targets": {"overhead_share_of_llama_cpp_server_at_most": TARGET_OVERHEAD_SHARE,
                    "health_median_ms_below": TARGET_HEALTH_MS},
        "meets_targets": meets, "texts_match": correct, "machine": machine(),
        "units": "ms are medians over interleaved rounds; overhead_ms = median(path) - median(in-process); "
                 "paired_overhead_ms = median over rounds of (path's round median - in-process round median), what "
                 "the targets and the HEADLINE use; "
                 "tokens_per_s = tokens / median stream time (request sent to last chunk)",
        "headline": headline,
    }


def print_table(r: dict[str, Any]) -> None:
    print(f"model {r['model']['file']}, n_ctx {r['n_ctx']}, {r['threads']} threads; medians of {r['requests']} "
          f"1-token requests, {r['streams']} {r['tokens']}-token requests and streams per path, interleaved")
    print(f"{'path':<18} {'1-tok ms':>9} {'+ms':>7} {'paired':>7} {'req ms':>8} {'+ms':>7} {'paired':>7} "
          f"{'stream ms':>10} {'tok/s':>7} {'ratio':>6} {'ttft ms':>8} text")
    for name, p in r["paths"].items():
        ttft = p["stream"]["ttft_median_ms"]
        print(f"{name:<18} {p['one']['median_ms']:>9.2f} {p['one']['overhead_ms']:>+7.2f} "
              f"{p['one']['paired_overhead_ms']:>+7.2f} {p['request']['median_ms']:>8.2f} "
              f"{p['request']['overhead_ms']:>+7.2f} {p['request']['paired_overhead_ms']:>+7.2f} "
              f"{p['stream']['median_ms']:>10.2f} {p['stream']['tokens_per_s']:>7.0f} "
              f"{p['stream']['tokens_per_s_ratio']:>6.2f} {'-' if ttft is None else f'{ttft:.2f}':>8} "
              f"{'ok' if p['text_matches_in_process'] else 'DIFFERS'}")
    health = r["health"]
    if health is not None:
        print(f"/v1/health: idle median {health['idle']['median_ms']:.2f} ms; under {health['load_streams']} "
              f"streaming chats median {health['under_load']['median_ms']:.2f} ms, p90 "
              f"{health['under_load']['p90_ms']:.2f} ms ({health['load_chunks_per_s']:.0f} chunks/s streamed "
              f"meanwhile)")
    for what, note in r["notes"].items():
        if note != "measured":
            print(f"{what}: {note}")
    print(f"targets met: {r['meets_targets']}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.http", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run")
    p.add_argument("--requests", type=int, default=None, help="1-token requests per path (default 100; quick 5)")
    p.add_argument("--streams", type=int, default=None,
                   help="full requests, and streams, per path (default 20; quick 2)")
    p.add_argument("--warmup", type=int, default=None, help="untimed 1-token requests per path first (default 10)")
    p.add_argument("--tokens", type=int, default=32, help="tokens of the full request and of the stream")
    p.add_argument("--load-streams", type=int, default=8, help="streaming chats running during the health probes")
    p.add_argument("--load-tokens", type=int, default=None, help="tokens per load chat (default 256; quick 32)")
    p.add_argument("--health-probes", type=int, default=None, help="GET /v1/health per phase (default 200)")
    p.add_argument("--no-llama-server", action="store_true", help="skip llama_cpp.server")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--threads", type=int, default=default_threads())
    add_output_args(p, NAME)
    args = p.parse_args(argv)
    fill_defaults(args, full={"requests": 100, "streams": 20, "warmup": 10, "load_tokens": 256, "health_probes": 200},
                  quick={"requests": 5, "streams": 2, "warmup": 2, "load_tokens": 32, "health_probes": 20})
    if min(args.requests, args.streams, args.warmup, args.load_streams, args.health_probes) < 1 or args.tokens < 2:
        p.error("counts must be >= 1 and --tokens >= 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    return finish(result, args.out, print_table, ok=result["texts_match"])


if __name__ == "__main__":
    raise SystemExit(main())
