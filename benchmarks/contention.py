"""A 64-token decode through the appliance while other processes keep the CPU busy: fixed threads against the
adaptive engine's (issue #12, SPEC E4).

Tried as a new user would, the fixed thread count turned a 0.1 s answer into 25 s once another process was busy:
llama.cpp's OpenMP threads, one per core, spin at their barriers against the other process. The adaptive engine
takes a CPU reading about once a second (the idle time plus its own share of ``/proc/stat``) and sets the live
context's threads from it (capped by the cores that share stands for).

One run, one model (12 layers x 768, f16; ``n_ctx`` 2048), two appliance processes (``appliance run``) started side
by side and warmed up (one untimed request each, then until ``/v1/health`` no longer says ``warming``):

* **fixed**: ``engine.adaptive: false``, ``engine.threads`` = today's default, ``min(4, cores)``;
* **adaptive**: ``engine.adaptive: true``, every other setting at its default.

Three conditions, in this order: the box idle; ``max(1, cores - 1)`` busy loops; one busy loop per core (each a
``python -c "while True: pass"`` process, killed after its condition). After starting the busy loops the run waits
``--wait`` s (3) so that the adaptive engine's once-a-second CPU reading sees them, and before each strategy's turn
``--settle`` s (2) so that the other server's decodes are out of that reading. Each strategy's turn (the order
alternated per condition) is one untimed warm-up decode, then ``--repeats`` (3) timed ones: the same short prompt,
64 greedy tokens, streamed over ``POST /v1/completions`` without ``user`` (stateless), timed from the request sent
to the last token; the median is reported. The prompt is chosen so that its greedy continuation is 64 tokens of plain
text (no early EOS). The threads each decode ran with come from its usage extension (``usage.threads``); the live
context's, from ``/v1/health`` after each decode, are kept too.

Target: with adaptive threads the contended decode takes at most 3x its idle time (both contended conditions);
fixed's ratio is printed beside it. Exit 1 when a decode did not deliver its 64 tokens.

Run ``python -m benchmarks.contention`` (``--quick``: the 4x256 model, one timed decode each, shorter waits).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from appliance.benchmark.session import Strategy, choices_of, chunk_text, completion_chunks, health
from benchmarks.agent_session import appliance_server
from benchmarks.common import (
    NOISY_SHARE,
    BoxLoad,
    add_output_args,
    default_threads,
    fill_defaults,
    finish,
    machine,
    tiny_model,
)
from benchmarks.concurrency import agent_prompts
from benchmarks.protocol.workload import MODEL_NAME

NAME = "contention"
TARGET_RATIO = 3.0
REQUEST_TIMEOUT_S = 300.0
BUSY_LOOP = "while True: pass"


def fixed_strategy(n_ctx: int) -> Strategy:
    threads = default_threads()
    return Strategy("fixed", f"engine.adaptive false, engine.threads {threads} (min(4, cores))",
                    {"adaptive": False, "threads": threads}, n_ctx)


def adaptive_strategy(n_ctx: int) -> Strategy:
    return Strategy("adaptive", "engine.adaptive true, engine defaults", {"adaptive": True}, n_ctx)


@dataclass(frozen=True)
class Condition:
    """How many busy loops compete with the decode."""

    name: str
    busy_loops: int


def conditions(cores: int) -> tuple[Condition, Condition, Condition]:
    return (Condition("idle", 0), Condition("cores_minus_one", max(1, cores - 1)), Condition("every_core", cores))


@contextlib.contextmanager
def busy_loops(count: int) -> Iterator[list[int]]:
    """``count`` CPU-bound processes (``while True: pass``), killed and reaped on exit; their pids."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(count):
            procs.append(subprocess.Popen([sys.executable, "-c", BUSY_LOOP]))
        yield [proc.pid for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait(10)


@dataclass
class Decode:
    """One streamed decode as the client saw it."""

    seconds: float | None = None
    ttft_ms: float | None = None
    tokens: int = 0
    text: str = ""
    usage: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def decode(base_url: str, prompt: str, max_tokens: int) -> Decode:
    """One stateless greedy streamed completion of ``max_tokens`` tokens, timed from the request to the last token."""
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    result = Decode()
    parts: list[str] = []
    first: float | None = None
    last: float | None = None
    try:
        with httpx.Client(base_url=base_url, timeout=REQUEST_TIMEOUT_S) as http:
            sent = time.perf_counter()
            for chunk in completion_chunks(http, body):
                if chunk.get("usage"):
                    result.usage = chunk["usage"]
                text = chunk_text(chunk)
                if text:
                    last = time.perf_counter()
                    first = last if first is None else first
                    parts.append(text)
    except Exception as exc:  # recorded; the run reports it and exits 1
        result.error = f"{type(exc).__name__}: {exc}"
    result.text = "".join(parts)
    result.tokens = int(result.usage.get("completion_tokens", 0)) if result.usage else 0
    if result.error is None and result.tokens != max_tokens:
        result.error = f"{result.tokens} tokens streamed, not {max_tokens}"
    if first is not None and last is not None:
        result.ttft_ms = (first - sent) * 1e3
        result.seconds = last - sent
    return result


def threads_now(base_url: str) -> list[Any]:
    """The threads of each live context, from ``/v1/health``."""
    return [record.get("threads") for record in choices_of(health(base_url))]


def turn(base_url: str, prompt: str, args: argparse.Namespace) -> dict[str, Any]:
    """One strategy's turn in one condition: an untimed warm-up decode, then ``args.repeats`` timed ones."""
    warm = decode(base_url, prompt, args.tokens)
    decodes = []
    threads = []
    for _ in range(args.repeats):
        decodes.append(decode(base_url, prompt, args.tokens))
        threads.append(threads_now(base_url))
    times = [d.seconds for d in decodes]
    errors = [d.error for d in (warm, *decodes) if d.error is not None]
    return {"seconds": times, "median_s": None if errors else statistics.median(t for t in times if t is not None),
            "ttft_ms": [d.ttft_ms for d in decodes], "warmup_s": warm.seconds,
            "threads_used": [d.usage.get("threads") for d in decodes], "context_threads": threads,
            "usage_extra": [{k: v for k, v in d.usage.items()
                             if k not in ("prompt_tokens", "completion_tokens", "total_tokens",
                                          "prompt_tokens_details")} for d in decodes],
            "texts_equal": len({d.text for d in (warm, *decodes)}) == 1, "errors": errors}


def ratio(value: float | None, base: float | None) -> float | None:
    return None if value is None or base is None or base == 0 else value / base


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model(args.model_dir, layers=args.layers, dim=args.dim, n_ctx_train=max(args.n_ctx, 4096))
    prompt = agent_prompts(model, 1, args.prompt_tokens, args.tokens, 1)[0].text
    strategies = [fixed_strategy(args.n_ctx), adaptive_strategy(args.n_ctx)]
    cores = os.cpu_count() or 1
    loadavg_start = os.getloadavg()
    load = BoxLoad()
    results: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        served = {s.name: stack.enter_context(appliance_server(model, s)) for s in strategies}
        for index, condition in enumerate(conditions(cores)):
            order = strategies if index % 2 == 0 else strategies[::-1]
            print(f"{condition.name}: {condition.busy_loops} busy loop(s), {order[0].name} then {order[1].name}",
                  flush=True)
            entry: dict[str, Any] = {"busy_loops": condition.busy_loops}
            with busy_loops(condition.busy_loops):
                if condition.busy_loops:
                    time.sleep(args.wait)
                for strategy in order:
                    time.sleep(args.settle)
                    entry[strategy.name] = turn(served[strategy.name].base_url, prompt, args)
            results[condition.name] = entry
    names = [c.name for c in conditions(cores)]
    ratios = {s.name: {name: ratio(results[name][s.name]["median_s"], results["idle"][s.name]["median_s"])
                       for name in names[1:]} for s in strategies}
    meets = {f"adaptive_{name}_at_most_{TARGET_RATIO:g}x_idle": (None if ratios["adaptive"][name] is None
                                                                 else ratios["adaptive"][name] <= TARGET_RATIO)
             for name in names[1:]}
    complete = all(not results[name][s.name]["errors"] for name in names for s in strategies)
    result: dict[str, Any] = {
        "benchmark": NAME, "quick": args.quick,
        "model": {"file": model.name, "layers": args.layers, "dim": args.dim, "dtype": "f16"},
        "n_ctx": args.n_ctx, "cores": cores, "tokens": args.tokens, "prompt_tokens": args.prompt_tokens,
        "prompt": prompt, "repeats": args.repeats, "wait_s": args.wait, "settle_s": args.settle,
        "strategies": {s.name: {"label": s.label, "engine": s.engine} for s in strategies},
        "by_condition": results, "ratio_to_idle": ratios,
        "targets": {"adaptive_contended_to_idle_at_most": TARGET_RATIO}, "meets_targets": meets,
        "complete": complete, "box_load": load.figures(), "loadavg_start": loadavg_start,
        "loadavg_end": os.getloadavg(), "machine": machine(),
        "units": "seconds = request sent to last streamed token of a 64-token greedy decode (client side), median of "
                 "the repeats; ratio_to_idle = median contended / median idle, per strategy; box_load counts the "
                 "busy loops as this run's own",
    }
    result["headline"] = headline(result)
    return result


def headline(r: dict[str, Any]) -> str:
    def secs(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.2f} s"

    def times(name: str) -> str:
        parts = [f"idle {secs(r['by_condition']['idle'][name]['median_s'])}"]
        for condition, value in r["ratio_to_idle"][name].items():
            loops = r["by_condition"][condition]["busy_loops"]
            shown = "n/a" if value is None else f"{value:.1f}x"
            parts.append(f"{loops} busy {secs(r['by_condition'][condition][name]['median_s'])} ({shown})")
        return ", ".join(parts)

    met = [v for v in r["meets_targets"].values() if v is not None]
    verdict = "met" if met and all(met) and len(met) == len(r["meets_targets"]) else "NOT met"
    tail = "" if r["complete"] else "; INCOMPLETE: a decode failed"
    if r["box_load"]["other_processes_share_of_box"] > NOISY_SHARE:
        tail += f"; NOISY: other processes used {r['box_load']['other_processes_share_of_box']:.0%} of the CPU"
    fixed_threads = r["strategies"]["fixed"]["engine"]["threads"]
    return (f"HEADLINE: contention ({r['model']['layers']}x{r['model']['dim']} f16, {r['cores']} cores, "
            f"{r['tokens']}-token decode): adaptive {times('adaptive')}; fixed {fixed_threads} threads "
            f"{times('fixed')}; target adaptive contended <= {TARGET_RATIO:g}x idle: {verdict}{tail}")


def print_table(r: dict[str, Any]) -> None:
    print(f"model {r['model']['file']}, {r['cores']} cores, {r['tokens']}-token greedy decode (median of "
          f"{r['repeats']}); fixed: {r['strategies']['fixed']['label']}; "
          f"adaptive: {r['strategies']['adaptive']['label']}")
    print(f"{'condition':<16} {'loops':>5} {'fixed s':>9} {'x idle':>7} {'adaptive s':>11} {'x idle':>7} "
          f"{'adaptive threads':>17}")
    for name, entry in r["by_condition"].items():
        cells = []
        for strategy in ("fixed", "adaptive"):
            median = entry[strategy]["median_s"]
            factor = r["ratio_to_idle"][strategy].get(name, 1.0 if name == "idle" else None)
            cells.append("-" if median is None else f"{median:.3f}")
            cells.append("-" if factor is None else f"{factor:.1f}x")
        threads = ",".join("?" if t is None else str(t) for t in entry["adaptive"]["threads_used"])
        print(f"{name:<16} {entry['busy_loops']:>5} {cells[0]:>9} {cells[1]:>7} {cells[2]:>11} {cells[3]:>7} "
              f"{threads:>17}")
    for name, entry in r["by_condition"].items():
        for strategy in ("fixed", "adaptive"):
            if entry[strategy]["errors"]:
                print(f"{name} {strategy}: errors {entry[strategy]['errors']}")
    print(f"other processes used {r['box_load']['other_processes_share_of_box']:.0%} of the box's CPU (the busy "
          f"loops and servers are this run's own); load average {r['loadavg_start'][0]:.2f} at start")
    print(f"targets met: {r['meets_targets']}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.contention", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run (4x256 model, one timed decode)")
    p.add_argument("--repeats", type=int, default=None, help="timed decodes per strategy and condition (default 3; "
                                                             "quick 1)")
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens per decode")
    p.add_argument("--prompt-tokens", type=int, default=16, help="prompt tokens, BOS included")
    p.add_argument("--wait", type=float, default=None, help="seconds after starting the busy loops (default 3; "
                                                            "quick 2)")
    p.add_argument("--settle", type=float, default=None, help="seconds before each strategy's turn (default 2; "
                                                              "quick 1.5)")
    p.add_argument("--layers", type=int, default=None, help="model layers (default 12; quick 4)")
    p.add_argument("--dim", type=int, default=None, help="model width (default 768; quick 256)")
    p.add_argument("--n-ctx", type=int, default=2048, help="the model's n_ctx")
    add_output_args(p, NAME)
    args = p.parse_args(argv)
    fill_defaults(args, full={"repeats": 3, "wait": 3.0, "settle": 2.0, "layers": 12, "dim": 768},
                  quick={"repeats": 1, "wait": 2.0, "settle": 1.5, "layers": 4, "dim": 256})
    if min(args.repeats, args.tokens) < 1 or args.prompt_tokens < 2 or min(args.wait, args.settle) < 0:
        p.error("--repeats and --tokens must be >= 1, --prompt-tokens >= 2, --wait and --settle >= 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    return finish(result, args.out, print_table, ok=result["complete"])


if __name__ == "__main__":
    raise SystemExit(main())
