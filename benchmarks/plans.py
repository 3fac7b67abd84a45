"""Execution plans (issue #12 E3): which llama.cpp context parameters matter for short and for long prompts.

One :class:`~appliance.engine.batched.ModelWeights` (the 12-layer 768-wide f16 tiny model) and, for each
configuration, one :class:`~appliance.engine.batched.BatchedContext` (2 threads, 4 sequences, ``n_ctx`` 2048,
``n_batch`` 512, no ``prefill_limit``) built on them; the grid: ``n_ubatch`` 32-512 x flash attention off/on with
an f16 KV cache, and a q8_0 KV cache (flash attention on) at ``--kv-ubatches``. For each configuration and each
prompt length:

* **TTFT**: one prompt alone in the context, from joining to its first sampled token (best of ``--repeats``
  rounds: on a shared 2-core box the noise only adds, and a lot: two threads lose a scheduler tick at every
  barrier of the graph while a third process runs, so a graph of a few tokens may take 40x its idle time);
* **decode tokens/s**: 4 sequences whose prompts together are that many tokens (``length // 4`` each: the KV cache
  holds as many cells as the long prompt does), prefilled, then ``--decode-steps`` steps of 4 tokens timed one by
  one: 4 / the median step. A decode step of 4 tokens is one micro-batch whatever ``n_ubatch``, so this is
  measured at the largest ``n_ubatch`` only;
* **memory** (first round): VmRSS (``/proc/self/status``) after building the context and running the prompts (the
  longest included), minus before it was built: the KV cache plus llama.cpp's compute buffer (which grows with
  ``n_ubatch`` x ``n_ctx``); also the KV and compute buffer sizes llama.cpp logs.

The timings run in ``--repeats`` rounds, each going through every configuration (a fresh context each time), so
the noise of a shared box hits every configuration alike. Last, ``prefill_limit``: 3 streams decode while the
longest prompt joins them (f16, ``n_ubatch`` 512): the newcomer's TTFT and the streams' longest wait between two
tokens, for each ``--prefill-limits`` value.

A q8_0 V cache needs flash attention in llama.cpp: that configuration is tried, and its refusal recorded.
``python -m benchmarks.plans`` (about 10 min on 2 cores); ``--quick``: the 4x256 model, two lengths, two
``n_ubatch`` values, one round (a few seconds).
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import re
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.engine.batched import BatchedContext, ModelWeights
from appliance.errors import ApplianceError
from benchmarks.common import add_output_args, fill_defaults, finish, machine, tiny_model

FULL: dict[str, Any] = {"layers": 12, "dim": 768, "lengths": [32, 100, 300, 800, 1500],
                        "ubatches": [32, 64, 128, 256, 512], "repeats": 3, "decode_steps": 32,
                        "kv_ubatches": [128, 512], "prefill_limits": [None, 256, 128, 64, 32]}
QUICK: dict[str, Any] = {"layers": 4, "dim": 256, "lengths": [32, 128], "ubatches": [32, 512], "repeats": 1,
                         "decode_steps": 4, "kv_ubatches": [512],
                         "prefill_limits": [None, 32]}
N_CTX = 2048
N_BATCH = 512
N_SEQ = 4
THREADS = 2
FIRST_TOKEN = 3
"""Prompt tokens are drawn from ids FIRST_TOKEN.. (past the tiny vocabulary's special tokens)."""
MIB = 2**20
JOIN_STREAM_PROMPT = 32
"""Prompt tokens of each stream a long prompt joins (:func:`join_run`)."""
DECODE_MARGIN = 16
"""Tokens a decoding sequence may generate beyond the timed steps (while the others still prefill), so that all
``N_SEQ`` generate in every timed step."""


@dataclass(frozen=True)
class Config:
    n_ubatch: int
    flash_attn: bool
    cache_type: str

    def label(self) -> str:
        return f"ub{self.n_ubatch} fa{'1' if self.flash_attn else '0'} {self.cache_type}"


def rss_bytes() -> int:
    """This process's resident set (VmRSS)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


@contextmanager
def llama_log(lines: list[str]) -> Iterator[None]:
    """Collect what llama.cpp logs meanwhile into ``lines`` instead of stderr (llama-cpp-python's log callback
    prints to ``sys.stderr``; every level, as it maps ggml's ERROR to DEBUG)."""
    chatter = logging.getLogger("llama-cpp-python")
    level = chatter.level
    capture = io.StringIO()
    chatter.setLevel(logging.DEBUG)
    try:
        with redirect_stderr(capture):
            yield
    finally:
        chatter.setLevel(level)
        lines.extend(capture.getvalue().splitlines())


def buffer_mib(lines: list[str], kind: str) -> float | None:
    """The size llama.cpp logged for its CPU ``kind`` buffer ("KV", "compute"), in MiB."""
    for line in lines:
        found = re.search(rf"CPU {kind} buffer size =\s*([\d.]+) MiB", line)
        if found:
            return float(found.group(1))
    return None


def prompt(n_vocab: int, length: int, salt: int) -> list[int]:
    """A deterministic prompt of ``length`` tokens."""
    span = n_vocab - FIRST_TOKEN
    return [FIRST_TOKEN + (index * 7919 + salt * 104729) % span for index in range(length)]


def time_to_first_token(context: BatchedContext, tokens: list[int]) -> float:
    """Seconds from joining to the first sampled token of one prompt alone in ``context``."""
    start = time.perf_counter()
    context.add(0, tokens, max_tokens=1)
    while not context.step():
        pass
    elapsed = time.perf_counter() - start
    context.cancel(0)
    return elapsed


def decode_step_times(context: BatchedContext, n_vocab: int, length: int, steps: int) -> list[float]:
    """Seconds of each of ``steps`` decode steps of ``N_SEQ`` sequences whose prompts together are ``length``
    tokens (prefilled first, untimed)."""
    share = max(1, length // N_SEQ)
    for seq_id in range(N_SEQ):
        context.add(seq_id, prompt(n_vocab, share, seq_id + 1), max_tokens=steps + DECODE_MARGIN)
    started: set[int] = set()
    while len(started) < N_SEQ:
        started.update(event.seq_id for event in context.step())
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        events = context.step()
        times.append(time.perf_counter() - start)
        if len(events) != N_SEQ:
            raise RuntimeError(f"a decode step sampled {len(events)} tokens, not {N_SEQ}")
    for seq_id in range(N_SEQ):
        context.cancel(seq_id)
    return times


def open_context(weights: ModelWeights, config: Config, lines: list[str],
                 prefill_limit: int | None = None) -> BatchedContext:
    """The configuration's context; what llama.cpp logged while building it goes to ``lines``."""
    with llama_log(lines):
        return BatchedContext(weights, n_ctx=N_CTX, n_seq_max=N_SEQ, n_batch=N_BATCH, n_ubatch=config.n_ubatch,
                              n_threads=THREADS, prefill_limit=prefill_limit, flash_attn=config.flash_attn,
                              cache_type=config.cache_type)


def row_of(config: Config) -> dict[str, Any]:
    return {"n_ubatch": config.n_ubatch, "flash_attn": config.flash_attn, "cache_type": config.cache_type,
            "label": config.label()}


def measure_round(weights: ModelWeights, config: Config, args: argparse.Namespace, row: dict[str, Any],
                  ttft: dict[int, list[float]], steps: dict[int, list[float]]) -> None:
    """One round of a configuration: its TTFT at every length (appended to ``ttft``, seconds per run by length),
    its decode steps when it decodes (``steps``, seconds per step by length). On the first round (``row`` without
    ``memory_mib``) also what its context costs: VmRSS after building it and the prompts (the longest included),
    minus before, and llama.cpp's KV and compute buffers; a context llama.cpp refuses: ``row["refused"]``."""
    first = "memory_mib" not in row
    before = rss_bytes()
    lines: list[str] = []
    try:
        context = open_context(weights, config, lines)
    except ApplianceError as error:
        said = [line.strip() for line in lines if "requires" in line or "error" in line.lower()]
        row["refused"] = f"{error.code}: {error.message}" + (f" ({'; '.join(said)})" if said else "")
        return
    try:
        for length in args.lengths:
            ttft[length].append(time_to_first_token(context, prompt(weights.n_vocab, length, 0)))
        if first:
            row.update({"kv_buffer_mib": buffer_mib(lines, "KV"), "compute_buffer_mib": buffer_mib(lines, "compute"),
                        "memory_mib": (rss_bytes() - before) / MIB})
        if config.n_ubatch == max(args.ubatches):
            for length in args.lengths:
                steps[length].extend(decode_step_times(context, weights.n_vocab, length, args.decode_steps))
    finally:
        context.close()


def join_run(weights: ModelWeights, prefill_limit: int | None, length: int) -> tuple[float, float]:
    """``N_SEQ - 1`` streams decode (32-token prompts); a prompt of ``length`` tokens joins them. Returns the
    newcomer's time to first token and the streams' longest wait between two tokens meanwhile (seconds)."""
    context = open_context(weights, Config(N_BATCH, False, "f16"), [], prefill_limit)
    streams = N_SEQ - 1
    budget = (N_CTX - length - 1) // streams - JOIN_STREAM_PROMPT
    try:
        for seq_id in range(streams):
            context.add(seq_id, prompt(weights.n_vocab, JOIN_STREAM_PROMPT, seq_id + 1), max_tokens=budget)
        started: set[int] = set()
        while len(started) < streams:
            started.update(event.seq_id for event in context.step())
        context.step()
        newcomer = streams
        start = time.perf_counter()
        context.add(newcomer, prompt(weights.n_vocab, length, 0), max_tokens=1)
        longest = 0.0
        while True:
            step_start = time.perf_counter()
            events = context.step()
            longest = max(longest, time.perf_counter() - step_start)
            if len(events) < streams:
                raise RuntimeError("a stream ran out of tokens while the newcomer prefilled: raise n_ctx")
            if any(event.seq_id == newcomer for event in events):
                return time.perf_counter() - start, longest
    finally:
        context.close()


def measure_joins(weights: ModelWeights, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The newcomer's TTFT and the streams' longest gap for every ``prefill_limit`` (best of interleaved
    rounds)."""
    length = max(args.lengths)
    ttft: dict[int | None, list[float]] = {limit: [] for limit in args.prefill_limits}
    gap: dict[int | None, list[float]] = {limit: [] for limit in args.prefill_limits}
    for _ in range(args.repeats):
        for limit in args.prefill_limits:
            first, longest = join_run(weights, limit, length)
            ttft[limit].append(first)
            gap[limit].append(longest)
    return [{"prefill_limit": limit, "prompt_tokens": length, "streams": N_SEQ - 1,
             "ttft_ms": min(ttft[limit]) * 1000, "stream_gap_ms": min(gap[limit]) * 1000,
             "ttft_runs_ms": [value * 1000 for value in ttft[limit]],
             "stream_gap_runs_ms": [value * 1000 for value in gap[limit]]}
            for limit in args.prefill_limits]


def grid(args: argparse.Namespace) -> list[Config]:
    configs = []
    for cache_type in args.cache_types:
        for flash_attn in (False, True):
            for n_ubatch in (args.ubatches if cache_type == "f16" else args.kv_ubatches):
                configs.append(Config(n_ubatch, flash_attn, cache_type))
                if cache_type != "f16" and not flash_attn:
                    break  # refused whatever n_ubatch: llama.cpp needs flash attention for a quantized V cache
    return configs


def find(rows: list[dict[str, Any]], n_ubatch: int, flash_attn: bool, cache_type: str) -> dict[str, Any]:
    for row in rows:
        if (row["n_ubatch"], row["flash_attn"], row["cache_type"]) == (n_ubatch, flash_attn, cache_type):
            return row
    raise KeyError((n_ubatch, flash_attn, cache_type))


def headline(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    short = str(min(args.lengths))
    long = str(max(args.lengths))
    small = min(args.ubatches)
    large = max(args.ubatches)
    low = find(rows, small, False, "f16")
    high = find(rows, large, False, "f16")
    fa = find(rows, large, True, "f16")
    return (f"HEADLINE: plans {args.layers}x{args.dim} f16, 2 threads: {long}-token TTFT "
            f"{high['ttft_ms'][long]:.0f} ms at n_ubatch {large} vs {low['ttft_ms'][long]:.0f} ms at {small} "
            f"({low['ttft_ms'][long] / high['ttft_ms'][long]:.2f}x); {short}-token TTFT "
            f"{high['ttft_ms'][short]:.1f} vs {low['ttft_ms'][short]:.1f} ms; context memory "
            f"{high['memory_mib']:.0f} vs {low['memory_mib']:.0f} MiB; flash attention: {long}-token TTFT "
            f"{fa['ttft_ms'][long] / high['ttft_ms'][long]:.2f}x, decode beside {long} cells "
            f"{fa['decode_tokens_per_s'][long] / high['decode_tokens_per_s'][long]:.2f}x")


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model(args.model_dir, layers=args.layers, dim=args.dim, n_ctx_train=4096)
    started = time.perf_counter()
    with ModelWeights(model) as weights:
        load_before = os.getloadavg()
        configs = grid(args)
        rows = [row_of(config) for config in configs]
        ttft = [{length: [] for length in args.lengths} for _ in configs]
        steps = [{length: [] for length in args.lengths} for _ in configs]
        for round_index in range(args.repeats):  # interleaved: the box's noise hits every configuration alike
            for index, config in enumerate(configs):
                if "refused" not in rows[index]:
                    measure_round(weights, config, args, rows[index], ttft[index], steps[index])
            print(f"  round {round_index + 1}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
        joins = measure_joins(weights, args)
    for row, runs, times in zip(rows, ttft, steps, strict=True):
        if "refused" in row:
            continue
        row["ttft_ms"] = {str(length): min(values) * 1000 for length, values in runs.items()}
        row["ttft_runs_ms"] = {str(length): [value * 1000 for value in values] for length, values in runs.items()}
        if times[args.lengths[0]]:
            row["decode_tokens_per_s"] = {str(length): N_SEQ / statistics.median(values)
                                          for length, values in times.items()}
    return {"name": "plans", "benchmark": "plans", "quick": args.quick, "machine": machine(),
            "load_average": {"before": load_before, "after": os.getloadavg()},
            "model": {"layers": args.layers, "dim": args.dim, "dtype": "f16", "n_ctx_train": 4096},
            "n_ctx": N_CTX, "n_batch": N_BATCH, "n_seq_max": N_SEQ, "threads": THREADS, "lengths": args.lengths,
            "ubatches": args.ubatches, "kv_ubatches": args.kv_ubatches, "repeats": args.repeats,
            "decode_steps": args.decode_steps, "prefill_limits": args.prefill_limits,
            "seconds": time.perf_counter() - started, "configs": rows, "joins": joins,
            "headline": headline(rows, args)}


def print_table(result: dict[str, Any]) -> None:
    lengths = [str(length) for length in result["lengths"]]
    head = "".join(f"{'ttft ' + length:>11}" for length in lengths)
    tail = "".join(f"{'dec ' + length:>10}" for length in lengths)
    print(f"{'config':<16}{head}{tail}{'MiB':>7}{'kv':>6}{'comp':>6}")
    for row in result["configs"]:
        if "refused" in row:
            print(f"{row['label']:<16}refused: {row['refused']}")
            continue
        ttft = "".join(f"{row['ttft_ms'][length]:>11.1f}" for length in lengths)
        rates = row.get("decode_tokens_per_s")
        decode = "".join(f"{rates[length]:>10.0f}" if rates else f"{'-':>10}" for length in lengths)
        print(f"{row['label']:<16}{ttft}{decode}{row['memory_mib']:>7.0f}{row['kv_buffer_mib']:>6.0f}"
              f"{row['compute_buffer_mib']:>6.1f}")
    print(f"{'prefill_limit':<16}{'joining prompt':>16}{'its TTFT ms':>13}{'streams wait ms':>17}")
    for join in result["joins"]:
        limit = "none" if join["prefill_limit"] is None else str(join["prefill_limit"])
        print(f"{limit:<16}{join['prompt_tokens']:>16}{join['ttft_ms']:>13.0f}{join['stream_gap_ms']:>17.0f}")
    print("ttft: ms to the first token of one prompt alone (best of the rounds); dec: tokens/s of 4 sequences "
          "beside that many cells; MiB: VmRSS growth of the context; kv, comp: llama.cpp's KV, compute buffers (MiB)")


def prefill_limit(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.plans", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run on a tiny model")
    p.add_argument("--layers", type=int)
    p.add_argument("--dim", type=int)
    p.add_argument("--lengths", type=int, nargs="+", help="prompt lengths in tokens")
    p.add_argument("--ubatches", type=int, nargs="+", help="n_ubatch values (at most n_batch, 512)")
    p.add_argument("--kv-ubatches", type=int, nargs="+", help="n_ubatch values for the KV cache types but f16")
    p.add_argument("--repeats", type=int)
    p.add_argument("--decode-steps", type=int)
    p.add_argument("--prefill-limits", type=prefill_limit, nargs="+",
                   help="prefill_limit values for the joining prompt ('none': no limit)")
    p.add_argument("--cache-types", nargs="+", default=["f16", "q8_0"])
    add_output_args(p, "plans")
    args = p.parse_args(argv)
    fill_defaults(args, FULL, QUICK)
    if "f16" not in args.cache_types:
        p.error("--cache-types must include f16 (the headline compares against it)")
    return finish(run(args), Path(args.out), print_table)


if __name__ == "__main__":
    sys.exit(main())
