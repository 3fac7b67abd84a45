"""The measurement: interleaved rounds over the paths (:func:`rounds`), the samples and texts they record
(:func:`measure`), and each path's statistics against the in-process library call (:func:`summarize`)."""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

from benchmarks.protocol.workload import PROMPTS, Contender, Sample

SETTLE_S = 0.02  # pause before each path's turn (see rounds)
BLOCK = 10  # 1-token requests per path per round, back to back


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

