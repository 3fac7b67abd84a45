"""The report of a run: the overhead split, the targets, the JSON document with its HEADLINE, and the table."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from benchmarks.common import machine
from benchmarks.protocol.workload import PROMPTS

NAME = "protocol"
TARGET_OVERHEAD_MS = 0.3
TARGET_STREAM_RATIO = 0.97


def split_of(results: dict[str, Any]) -> dict[str, Any]:
    """Where MAGN's 1-token overhead goes: each step is the difference of two adjacent medians, so engine +
    daemon_core + transport + client_blocking = MagnClient's overhead (client_async likewise for AsyncMagnClient)."""
    med = {k: v["one_token"]["median_ms"] for k, v in results.items()}
    split: dict[str, Any] = {
        "engine_ms": med["engine"] - med["library"],
        "daemon_core_ms": med["daemon"] - med["engine"],
        "transport_ms": med["magn_raw"] - med["daemon"],
        "client_async_ms": med["magn_async"] - med["magn_raw"],
        "client_blocking_ms": med["magn"] - med["magn_raw"],
    }
    split["explained"] = ("engine = appliance Runtime vs llama-cpp-python (same thread); daemon_core = Daemon.complete "
                          "in an event loop vs Runtime (engine-thread hop, bookkeeping); transport = minimal MAGN "
                          "client to the appliance process vs Daemon.complete (framing, socket, server session, "
                          "process boundary); client_async = AsyncMagnClient vs the minimal client (its event loop, "
                          "reader and writer tasks, queues); client_blocking = MagnClient vs the minimal client (task "
                          "routing, building the Completion)")
    return split


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
                 f"({http['one_token']['overhead_ms']:+.2f} ms)" if http else "HTTP llama_cpp.server skipped")
    appl_http = results.get("http_appliance")
    if appl_http:
        http_part += (f", HTTP appliance {appl_http['one_token']['median_ms']:.2f} ms "
                      f"({appl_http['one_token']['overhead_ms']:+.2f} ms)")
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
        "machine": machine(),
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
