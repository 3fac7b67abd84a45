"""The KV-heavy case: the adaptive engine's peak memory against the fixed strategy's on a model whose KV cache
dwarfs its weights (12x768 f16 at ``n_ctx`` 16384: 576 MiB of KV cache preallocated by the fixed strategy).

Two workloads (seeded), each run by both strategies in fresh ``appliance run`` processes, one after the other, the
order alternated per repetition (``--repeats``); the agents and the appliance are those of
``benchmarks/agent_session.py`` (streamed ``/v1/completions``, the whole history re-sent, ``user`` naming the
conversation):

* **short**: 1 agent, ``--short-rounds`` (4) short turns: inputs of 50-100 tokens, 16-token answers;
* **four_agents**: the agent session, 4 agents x ``--rounds`` (8) rounds, inputs of 50-600 tokens, 16- or
  128-token answers with even odds: the conversations grow to thousands of cells each.

Strategies: **fixed** (``engine.adaptive: false``: the model's whole ``n_ctx`` preallocated as one pool) and
**adaptive** (``engine.adaptive: true``, every other engine setting at its default). Figure: peak memory = VmHWM of
the appliance process at the end of the session (medians over the repetitions). Targets, adaptive / fixed: at most
0.7 on the short session, at most 1.0 on the four-agent one (the hot pool may grow to ``n_ctx``, but a resize or a
long request must never hold two contexts whose sum passes it).

Run ``python -m benchmarks.kv_pool`` (``--quick``: the 4x256 model at ``n_ctx`` 2048, 2 rounds each).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from appliance.benchmark.session import (
    Phase,
    Workload,
    adaptive_strategy,
    fixed_strategy,
    session_workload,
    turn,
)
from appliance.engine.gguf_meta import kv_bytes, read_model_shape
from benchmarks.agent_session import interleaved_runs
from benchmarks.common import NOISY_SHARE, BoxLoad, add_output_args, fill_defaults, finish, machine, tiny_model

NAME = "kv_pool"
SHORT_INPUT = (50, 100)
SHORT_OUTPUT = 16
TARGETS = {"short": 0.7, "four_agents": 1.0}
"""The most adaptive's peak memory may be, as a share of fixed's, per workload."""
FULL = {"layers": 12, "dim": 768, "n_ctx": 16384, "rounds": 8, "short_rounds": 4}
QUICK = {"layers": 4, "dim": 256, "n_ctx": 2048, "rounds": 2, "short_rounds": 2}


def short_workload(rounds: int, seed: int) -> Workload:
    """One agent, short turns: what a single assistant session asks of the pool."""
    rng = random.Random(seed + 7)
    turns = [[turn(rng, SHORT_INPUT, SHORT_OUTPUT)] for _ in range(rounds)]
    return Workload("short", f"1 agent x {rounds} rounds, inputs {SHORT_INPUT[0]}-{SHORT_INPUT[1]} tokens, "
                    f"{SHORT_OUTPUT} tokens out", turns, (Phase("all", 0, rounds),))


def four_agent_workload(rounds: int, seed: int) -> Workload:
    plain = session_workload(4, rounds, seed)
    return Workload("four_agents", plain.description, plain.turns, plain.phases)


def peak_of(runs: Sequence[dict[str, Any]], workload: str, strategy: str) -> float | None:
    """The median peak memory (bytes) of ``strategy``'s complete runs of ``workload``; None without one."""
    peaks = [run["figures"]["peak_memory_bytes"] for run in runs
             if run["workload"] == workload and run["strategy"] == strategy and not run["errors"]
             and run["figures"]["peak_memory_bytes"] is not None]
    return statistics.median(peaks) if peaks else None


def compare(runs: Sequence[dict[str, Any]], workload: str) -> dict[str, Any]:
    fixed = peak_of(runs, workload, "fixed")
    adaptive = peak_of(runs, workload, "adaptive")
    ratio = adaptive / fixed if fixed and adaptive is not None else None
    pools = [sample["contexts"] for run in runs if run["workload"] == workload and run["strategy"] == "adaptive"
             for sample in run["rounds"]]
    largest = max((record.get("pool_cells") or 0 for records in pools for record in records), default=None)
    colds = max((record.get("cold_cells") or 0 for records in pools for record in records), default=None)
    return {"fixed_peak_bytes": fixed, "adaptive_peak_bytes": adaptive, "ratio": ratio,
            "target_at_most": TARGETS[workload], "met": None if ratio is None else ratio <= TARGETS[workload],
            "adaptive_largest_pool_cells": largest, "adaptive_largest_cold_cells": colds}


def headline(result: dict[str, Any]) -> str:
    parts = []
    for workload, compared in result["comparison"].items():
        ratio = compared["ratio"]
        shown = "n/a" if ratio is None else f"{ratio:.2f}x"
        verdict = "n/a" if compared["met"] is None else ("met" if compared["met"] else "MISSED")
        mib = compared["adaptive_peak_bytes"], compared["fixed_peak_bytes"]
        sizes = "" if None in mib else f" ({mib[0] / 2**20:.0f} vs {mib[1] / 2**20:.0f} MiB)"
        parts.append(f"{workload} {shown}{sizes}, target <= {compared['target_at_most']:g}x {verdict}")
    line = (f"HEADLINE: kv_pool ({result['model']['layers']}x{result['model']['dim']} f16, n_ctx {result['n_ctx']}, "
            f"KV {result['fixed_kv_bytes'] / 2**20:.0f} MiB preallocated by fixed) adaptive peak memory / fixed: "
            + "; ".join(parts))
    share = result["box_load"]["other_processes_share_of_box"]
    if share > NOISY_SHARE:
        line += f"; NOISY: other processes used {share:.0%} of the CPU"
    return line


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model(args.model_dir, layers=args.layers, dim=args.dim, n_ctx_train=args.n_ctx)
    workloads = [short_workload(args.short_rounds, args.seed), four_agent_workload(args.rounds, args.seed)]
    fixed = fixed_strategy(args.n_ctx)
    adaptive = adaptive_strategy(args.n_ctx)
    load = BoxLoad()
    started = time.perf_counter()
    runs = interleaved_runs(model, workloads, fixed, adaptive, args.repeats)
    result: dict[str, Any] = {
        "benchmark": NAME, "quick": args.quick,
        "model": {"file": model.name, "layers": args.layers, "dim": args.dim, "dtype": "f16"},
        "n_ctx": args.n_ctx, "rounds": args.rounds, "short_rounds": args.short_rounds, "repeats": args.repeats,
        "seed": args.seed, "wall_s": time.perf_counter() - started,
        "fixed_kv_bytes": kv_bytes(read_model_shape(model), args.n_ctx),
        "workloads": {w.name: w.description for w in workloads},
        "strategies": {s.name: {"label": s.label, "engine": s.engine} for s in (fixed, adaptive)},
        "comparison": {w.name: compare(runs, w.name) for w in workloads},
        "complete": all(not run["errors"] for run in runs),
        "runs": runs, "box_load": load.figures(), "machine": machine(),
        "units": "peak bytes = VmHWM of the appliance process at the end of the session (median over repetitions); "
                 "ratio = adaptive / fixed (lower is better)",
    }
    result["headline"] = headline(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"{'workload':<12} {'fixed MiB':>10} {'adaptive MiB':>13} {'ratio':>7} {'target':>7} {'largest pool':>13} "
          f"{'largest cold':>13}")
    for workload, c in result["comparison"].items():
        def mib(value: float | None) -> str:
            return "n/a" if value is None else f"{value / 2**20:.0f}"

        ratio = "n/a" if c["ratio"] is None else f"{c['ratio']:.2f}"
        print(f"{workload:<12} {mib(c['fixed_peak_bytes']):>10} {mib(c['adaptive_peak_bytes']):>13} {ratio:>7} "
              f"{c['target_at_most']:>7g} {c['adaptive_largest_pool_cells']!s:>13} "
              f"{c['adaptive_largest_cold_cells']!s:>13}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_pool", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run (4x256 model, n_ctx 2048, 2 rounds)")
    p.add_argument("--layers", type=int, help="model layers (default 12; quick 4)")
    p.add_argument("--dim", type=int, help="model width (default 768; quick 256)")
    p.add_argument("--n-ctx", type=int, help="the model's n_ctx (default 16384; quick 2048)")
    p.add_argument("--rounds", type=int, help="rounds of the four-agent session (default 8; quick 2)")
    p.add_argument("--short-rounds", type=int, help="rounds of the short session (default 4; quick 2)")
    p.add_argument("--repeats", type=int, default=1, help="repetitions of fixed and adaptive, order alternated")
    p.add_argument("--seed", type=int, default=0, help="the workloads' seed")
    add_output_args(p, NAME)
    args = p.parse_args(argv)
    fill_defaults(args, FULL, QUICK)
    if min(args.rounds, args.short_rounds, args.repeats) < 1:
        p.error("--rounds, --short-rounds and --repeats must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    return finish(result, Path(args.out), print_table, ok=result["complete"])


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
