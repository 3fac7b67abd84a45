"""A multi-turn agent session through the appliance, its fixed strategy against its adaptive engine (issue #12,
SPEC E1-E4).

The workload (the seed's), the same for every strategy (seeded): ``--agents`` agents (4) at once, each its own
conversation, ``--rounds`` rounds (20). In a round every agent sends its turn at the same time (``POST
/v1/completions``, streamed, greedy, ``user`` naming its conversation, the whole history re-sent as OpenAI clients do:
the appliance decodes only the new text) and the next round starts when all have answered. A turn adds a tool
result or user turn of random text (words of the tiny vocabulary, one token each, seeded) and asks for a short tool
call (``max_tokens`` 16) or a long answer (128); greedy decoding may end one sooner (EOS), and the generated tokens
are counted from the usage chunk. Two workloads:

* **session**: inputs of 50-600 tokens, each turn a tool call or a long answer with even odds;
* **phase_shift**: the first half of the rounds short tool calls (inputs 50-100, 16 tokens out), the second half
  long documents (inputs 400-600, 128-token answers); each phase is also measured on its own.

When an agent's conversation would pass the model's ``n_ctx`` (what it holds + the turn's input + ``max_tokens`` +
16), the agent starts a new conversation (a new ``user`` name, the history dropped), as a client would, and
unregisters the one it left (line protocol ``UNREGISTER``, after the round in which the new one registered: left
registered, every old conversation's KV would stay parked in host RAM, 140 MB each here, until
``agent_idle_ttl_s`` and swamp the memory figures of both strategies alike). The JSON counts these rollovers.

Strategies, each in a fresh ``appliance run`` process (so its peak RSS is its own), one after the other in one run,
the order alternated per repetition (``--repeats``):

* **fixed**: what a user gets without the appliance's tuning: ``engine.adaptive: false``, the model's full ``n_ctx``
  (4096) preallocated, ``engine.threads`` = llama-cpp-python's default (``Llama()``'s ``n_threads``:
  ``max(1, os.cpu_count() // 2)``) and its default batch (512: the fixed plan's ``n_batch = n_ubatch =
  min(512, n_ctx)``);
* **adaptive**: ``engine.adaptive: true`` and every other engine setting at its default;
* **grid** (on the phase-shift workload; ``--no-grid`` skips it): static configurations, ``engine.adaptive: false``
  with ``engine.threads`` in {1, 2} x model ``n_ctx`` in {1024, 4096}; a grid point equal to the fixed strategy's
  settings reuses the fixed run. The best per phase (tokens/s) is what adaptive should come within 5 % of.

Each server gets one untimed stateless request (the model loaded), then the run waits until ``/v1/health`` no longer
says ``warming`` (the adaptive engine's warm-up runs, SPEC E5). After each round the appliance's ``/v1/health`` is
read (each ``contexts`` record: ``pool_cells``, ``plan``, ``threads``: what the engine chose) with its VmRSS.

Figures per run: TTFT (client side: request sent to first streamed text) average and P99 over every turn; tokens/s
= generated tokens / wall time (the rounds' walls added: first request sent to last token); peak memory = VmHWM of
the appliance process at the end; memory growth = VmRSS at the end - VmRSS after round 1. With several repetitions
the table shows the median of each figure.

Targets, adaptive against fixed: peak memory >= 30 % lower, P99 TTFT >= 20 % lower, tokens/s not lower, and each
phase's tokens/s within 5 % of the best static configuration's. A target not met is printed with its measured
figure and the knob that moves it. Exit 1 when a turn failed.

Run ``python -m benchmarks.agent_session`` (``--quick``: the 4x256 model, 2 agents, 3 rounds, no grid).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml

from appliance.benchmark.servers import appliance_process, free_port, state_folder
from appliance.benchmark.session import (
    DOCUMENT_PHASE_INPUT,
    FIGURE_KEYS,
    LONG_OUTPUT,
    ROLLOVER_MARGIN,
    Phase,
    Served,
    Strategy,
    Workload,
    adaptive_strategy,
    figures,
    fixed_strategy,
    improvement,
    median_figures,
    phase_shift_workload,
    run_session,
    session_workload,
)
from appliance.engine.gguf_meta import kv_bytes, read_model_shape
from benchmarks.common import (
    NOISY_SHARE,
    BoxLoad,
    add_output_args,
    fill_defaults,
    finish,
    machine,
    tiny_model,
)
from benchmarks.protocol.servers import appliance_config
from benchmarks.protocol.workload import MODEL_NAME

NAME = "agent_session"
GRID_THREADS = (1, 2)
GRID_N_CTX = (1024, 4096)
TARGET_PEAK_MEMORY_LOWER = 0.30
TARGET_TTFT_P99_LOWER = 0.20
TARGET_OF_BEST_STATIC = 0.95
TURN_KEYS = ("plan", "threads", "peak_memory_bytes")
"""The keys of a turn's usage extension (SPEC E6) kept in the adaptive choices: what each turn ran with."""
KNOBS = {
    "peak_memory": "the hot pool: engine.hot_pool_slack x the P90 KV need of the profiled requests (the need is set "
                   "by the conversations' length: a shorter rollover, a smaller pool); the weights and the Python "
                   "runtime are a floor no setting moves",
    "ttft_p99": "the longest prefill (a 600-token turn beside the others): threads (engine.thread_idle_thresholds, "
                "engine.threads) and the plan's batch (engine.plan_boundaries)",
    "tokens_per_s": "threads (engine.thread_idle_thresholds, engine.threads) and the plan (engine.plan_boundaries)",
    "of_best_static": "the thread count the CPU reading picks (engine.thread_idle_thresholds) and the plan "
                      "(engine.plan_boundaries) against the best grid point",
}


# -- the strategies ------------------------------------------------------------------------------------------------


def static_strategy(threads: int, n_ctx: int) -> Strategy:
    return Strategy(f"static_t{threads}_c{n_ctx}", f"engine.adaptive false, threads {threads}, n_ctx {n_ctx}",
                    {"adaptive": False, "threads": threads}, n_ctx)


def session_config(model: Path, state: Path, strategy: Strategy, http_port: int) -> str:
    """``benchmarks.protocol``'s appliance config with the strategy's ``engine:`` keys and ``n_ctx``; an engine key
    the strategy does not name keeps its default."""
    doc = yaml.safe_load(appliance_config(model, state, n_ctx=strategy.n_ctx, threads=0, http_port=http_port))
    doc["engine"] = dict(strategy.engine)
    return yaml.safe_dump(doc, sort_keys=False)


@contextlib.contextmanager
def appliance_server(model: Path, strategy: Strategy) -> Iterator[Served]:
    """The appliance in its own process with the strategy's settings, answering and warmed up."""
    state = state_folder()
    port = free_port()
    with appliance_process(state, session_config(model, state, strategy, port), port, MODEL_NAME,
                           f"the appliance ({strategy.label})") as served:
        yield served


# -- running a session ---------------------------------------------------------------------------------------------


def interleaved_runs(model: Path, workloads: Sequence[Workload], fixed: Strategy, adaptive: Strategy,
                     repeats: int) -> list[dict[str, Any]]:
    """Every workload under both strategies, ``repeats`` times, the strategies' order alternating per repetition."""
    runs: list[dict[str, Any]] = []
    for repeat in range(repeats):
        order = [fixed, adaptive] if repeat % 2 == 0 else [adaptive, fixed]
        print(f"repetition {repeat + 1} of {repeats}, order {order[0].name} then {order[1].name}", flush=True)
        for workload in workloads:
            for strategy in order:
                runs.append(measure(model, strategy, workload, repeat))
    return runs


def measure(model: Path, strategy: Strategy, workload: Workload, repeat: int) -> dict[str, Any]:
    """One fresh appliance process running ``workload``: its figures, per phase too, and every round's sample."""
    print(f"  {workload.name}: {strategy.name} ({strategy.label}) ...", flush=True)
    with appliance_server(model, strategy) as served:
        started = time.perf_counter()
        results, samples, agents = run_session(served, workload, strategy.n_ctx)
        elapsed = time.perf_counter() - started
        errors = [{"agent": r.agent, "round": r.round, "error": r.error} for r in results if r.error is not None]
        log_tail = served.tail() if errors else None
    rounds = len(workload.turns)
    return {
        "workload": workload.name, "strategy": strategy.name, "repeat": repeat, "elapsed_s": elapsed,
        "figures": figures(results, samples, 0, rounds),
        "phases": {phase.name: figures(results, samples, phase.first, phase.end) for phase in workload.phases},
        "rollovers": sum(agent.rollovers for agent in agents), "errors": errors, "server_log_tail": log_tail,
        "rounds": [asdict(sample) for sample in samples],
        "turns": [{"agent": r.agent, "round": r.round, "user": r.user, "input_tokens": r.input_tokens,
                   "max_tokens": r.max_tokens, "ttft_ms": r.ttft_ms, "completion_tokens": r.completion_tokens,
                   "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens,
                   "usage_extra": {k: v for k, v in r.usage.items()
                                   if k not in ("prompt_tokens", "completion_tokens", "total_tokens",
                                                "prompt_tokens_details")},
                   "error": r.error} for r in results],
    }


# -- the report ----------------------------------------------------------------------------------------------------


def phase_medians(runs: Sequence[dict[str, Any]], phase: str | None) -> dict[str, Any]:
    """Each figure's median over the repetitions (of one phase, or of the whole run)."""
    return median_figures([run["figures"] if phase is None else run["phases"][phase] for run in runs])


def compare(runs: Sequence[dict[str, Any]], workload: str) -> dict[str, Any]:
    fixed = phase_medians([r for r in runs if r["workload"] == workload and r["strategy"] == "fixed"], None)
    adaptive = phase_medians([r for r in runs if r["workload"] == workload and r["strategy"] == "adaptive"], None)
    return {"fixed": fixed, "adaptive": adaptive,
            "improvement": {key: improvement(key, fixed[key], adaptive[key]) for key in FIGURE_KEYS}}


def adaptive_choices(runs: Sequence[dict[str, Any]], workload: str) -> list[dict[str, Any]]:
    """What the adaptive engine ran with after each round of ``workload`` (the first repetition)."""
    for run in runs:
        if run["workload"] == workload and run["strategy"] == "adaptive":
            return [{"round": sample["round"] + 1, "contexts": sample["contexts"],
                     "cold_requests": sample["engine"].get("cold_requests"),
                     "turns": [{key: t["usage_extra"].get(key) for key in TURN_KEYS}
                               for t in run["turns"] if t["round"] == sample["round"]]}
                    for sample in run["rounds"]]
    return []


def choices_line(choices: Sequence[dict[str, Any]]) -> str:
    """The rounds at which the adaptive engine's pool, plan or threads changed: ``r1 512/S/2t, r4 1024/M/2t``."""
    parts: list[str] = []
    last = None
    for entry in choices:
        contexts = entry["contexts"]
        if not contexts:
            shown = "no live context"
        else:
            record = contexts[0]
            shown = f"{record.get('pool_cells', '?')}/{record.get('plan', '?')}/{record.get('threads', '?')}t"
            if record.get("cold_cells"):
                shown += f" cold {record['cold_cells']}"
        if shown != last:
            parts.append(f"r{entry['round']} {shown}")
            last = shown
    return ", ".join(parts) if parts else "nothing recorded"


def turns_line(choices: Sequence[dict[str, Any]]) -> str:
    """How many of the adaptive run's turns ran with each plan and thread count (their usage extension), and how
    many requests the engine ran in a cold context."""
    counts: Counter[str] = Counter()
    for entry in choices:
        for turn_record in entry["turns"]:
            counts[f"{turn_record.get('plan', '?')}/{turn_record.get('threads', '?')}t"] += 1
    shown = ", ".join(f"{key} x{count}" for key, count in sorted(counts.items()))
    cold = choices[-1]["cold_requests"] if choices else None
    return f"{shown or 'nothing recorded'}; cold-context requests {'?' if cold is None else cold}"


def grid_report(runs: Sequence[dict[str, Any]], grid: Sequence[Strategy], reused: dict[str, str],
                phases: Sequence[Phase]) -> dict[str, Any]:
    """Per phase of the phase-shift workload: each static configuration's figures, the best (tokens/s) and
    adaptive's tokens/s against it."""
    by_phase: dict[str, dict[str, Any]] = {}
    best: dict[str, Any] = {}
    adaptive_vs_best: dict[str, float | None] = {}
    adaptive_runs = [r for r in runs if r["workload"] == "phase_shift" and r["strategy"] == "adaptive"]
    for phase in phases:
        table = {}
        for strategy in grid:
            source = reused.get(strategy.name, strategy.name)
            chosen = [r for r in runs if r["workload"] == "phase_shift" and r["strategy"] == source]
            table[strategy.name] = phase_medians(chosen, phase.name)
        by_phase[phase.name] = table
        rated = {name: f["tokens_per_s"] for name, f in table.items() if f["tokens_per_s"] is not None}
        if not rated:
            best[phase.name] = None
            adaptive_vs_best[phase.name] = None
            continue
        top = max(rated, key=rated.__getitem__)
        best[phase.name] = {"strategy": top, "tokens_per_s": rated[top]}
        ours = phase_medians(adaptive_runs, phase.name)["tokens_per_s"]
        adaptive_vs_best[phase.name] = None if ours is None else ours / rated[top]
    return {"configs": {s.name: {"label": s.label, "engine": s.engine, "n_ctx": s.n_ctx,
                                 "reuses": reused.get(s.name)} for s in grid},
            "by_phase": by_phase, "best": best, "adaptive_tokens_per_s_vs_best": adaptive_vs_best}


TARGET_FIGURES = (("peak_memory_30pct_lower", "peak_memory_bytes", TARGET_PEAK_MEMORY_LOWER, "peak_memory"),
                  ("ttft_p99_20pct_lower", "ttft_p99_ms", TARGET_TTFT_P99_LOWER, "ttft_p99"),
                  ("tokens_per_s_not_lower", "tokens_per_s", 0.0, "tokens_per_s"))
"""Each target against fixed: its name, the figure, the improvement it needs and its knob in :data:`KNOBS`."""


def targets_met(compared: dict[str, dict[str, Any]], grid: dict[str, Any] | None) -> dict[str, bool | None]:
    out: dict[str, bool | None] = {}
    for workload, c in compared.items():
        for name, key, needed, _ in TARGET_FIGURES:
            gain = c["improvement"][key]
            out[f"{workload}_{name}"] = None if gain is None else gain >= needed
    if grid is not None:
        for phase, value in grid["adaptive_tokens_per_s_vs_best"].items():
            out[f"phase_shift_{phase}_within_5pct_of_best_static"] = (None if value is None
                                                                      else value >= TARGET_OF_BEST_STATIC)
    return out


def missed(meets: dict[str, bool | None], compared: dict[str, dict[str, Any]],
           grid: dict[str, Any] | None) -> dict[str, dict[str, str]]:
    """For each target not met: the measured figure and the knob that moves it."""
    out: dict[str, dict[str, str]] = {}
    for workload, c in compared.items():
        for name, key, _, knob in TARGET_FIGURES:
            target = f"{workload}_{name}"
            if meets[target] is False:
                out[target] = {"measured": f"adaptive {c['improvement'][key]:+.1%} against fixed ({key}: fixed "
                                           f"{c['fixed'][key]:.4g}, adaptive {c['adaptive'][key]:.4g})",
                               "knob": KNOBS[knob]}
    if grid is not None:
        for phase, value in grid["adaptive_tokens_per_s_vs_best"].items():
            target = f"phase_shift_{phase}_within_5pct_of_best_static"
            if meets[target] is False:
                best = grid["best"][phase]
                out[target] = {"measured": f"adaptive at {value:.2f}x the tokens/s of {best['strategy']} "
                                           f"({best['tokens_per_s']:.1f})", "knob": KNOBS["of_best_static"]}
    return out


def memory_floor(model: Path, n_ctx: int) -> dict[str, int]:
    """The model's weight bytes and the fixed strategy's preallocated KV bytes: the most a smaller pool can save."""
    shape = read_model_shape(model)
    return {"weights_bytes": shape.weight_bytes, "fixed_kv_bytes": kv_bytes(shape, n_ctx)}


def headline(result: dict[str, Any]) -> str:
    def change(key: str, gain: float | None, unit: str) -> str:
        if gain is None:
            return f"{unit} n/a"
        if key == "tokens_per_s":
            return f"{unit} {gain:+.0%}"
        return f"{unit} {abs(gain):.0%} {'lower' if gain >= 0 else 'higher'}"

    parts = []
    for workload, c in result["comparison"].items():
        gain = c["improvement"]
        parts.append(f"{workload}: {change('peak_memory_bytes', gain['peak_memory_bytes'], 'peak memory')}, "
                     f"{change('ttft_p99_ms', gain['ttft_p99_ms'], 'P99 TTFT')}, "
                     f"{change('tokens_per_s', gain['tokens_per_s'], 'tokens/s')}")
    grid = result["grid"]
    if grid is not None:
        ratios = ", ".join(f"{phase} {'n/a' if v is None else f'{v:.2f}x'}"
                           for phase, v in grid["adaptive_tokens_per_s_vs_best"].items())
        parts.append(f"tokens/s of the best static config: {ratios}")
    met = [v for v in result["meets_targets"].values() if v]
    parts.append(f"targets met {len(met)}/{len(result['meets_targets'])}")
    if result["box_load"]["other_processes_share_of_box"] > NOISY_SHARE:
        parts.append(f"NOISY: other processes used {result['box_load']['other_processes_share_of_box']:.0%} of "
                     f"the CPU")
    if not result["complete"]:
        parts.append("INCOMPLETE: a turn failed")
    model = result["model"]
    return (f"HEADLINE: agent_session ({model['layers']}x{model['dim']} f16, {result['agents']} agents x "
            f"{result['rounds']} rounds, n_ctx {result['n_ctx']}) adaptive vs fixed: " + "; ".join(parts))


def print_table(r: dict[str, Any]) -> None:
    print(f"model {r['model']['file']}, {r['agents']} agents x {r['rounds']} rounds, {r['repeats']} repetition(s) "
          f"(median); fixed: {r['strategies']['fixed']['label']}; adaptive: {r['strategies']['adaptive']['label']}")
    print(f"{'workload':<12} {'figure':<20} {'fixed':>10} {'adaptive':>10} {'improvement':>12}  (+ = adaptive better)")
    rows = (("ttft_avg_ms", "TTFT avg (ms)", 1.0, ".1f"), ("ttft_p99_ms", "TTFT P99 (ms)", 1.0, ".1f"),
            ("tokens_per_s", "tokens/s", 1.0, ".1f"), ("peak_memory_bytes", "peak memory (MiB)", 2**20, ".0f"),
            ("memory_growth_bytes", "memory growth (MiB)", 2**20, ".0f"))
    for workload, c in r["comparison"].items():
        for key, label, scale, spec in rows:
            def shown(value: float | None, scale: float = scale, spec: str = spec) -> str:
                return "-" if value is None else format(value / scale, spec)

            gain = c["improvement"][key]
            print(f"{workload:<12} {label:<20} {shown(c['fixed'][key]):>10} {shown(c['adaptive'][key]):>10} "
                  f"{'-' if gain is None else f'{gain:+.0%}':>12}")
        print(f"{workload:<12} adaptive's hot context (pool cells/plan/threads) after each round: "
              f"{choices_line(r['adaptive_choices'][workload])}")
        print(f"{workload:<12} adaptive's turns ran with (plan/threads): {turns_line(r['adaptive_choices'][workload])}")
    for run in r["runs"]:
        if run["rollovers"]:
            print(f"{run['workload']} {run['strategy']} (rep {run['repeat']}): {run['rollovers']} conversation(s) "
                  f"started anew on reaching n_ctx")
    grid = r["grid"]
    if grid is not None:
        for phase, table in grid["by_phase"].items():
            cells = ", ".join(f"{name} {'-' if f['tokens_per_s'] is None else format(f['tokens_per_s'], '.1f')}"
                              for name, f in table.items())
            ratio = grid["adaptive_tokens_per_s_vs_best"][phase]
            print(f"grid, phase_shift {phase} tokens/s: {cells}; adaptive "
                  f"{'-' if ratio is None else f'{ratio:.2f}x'} of the best")
    floor = r["memory_floor"]
    print(f"memory: weights {floor['weights_bytes'] / 2**20:.0f} MiB, fixed's preallocated KV "
          f"{floor['fixed_kv_bytes'] / 2**20:.0f} MiB (the most a smaller hot pool can save)")
    load = r["box_load"]
    print(f"other processes used {load['other_processes_share_of_box']:.0%} of the box's CPU during the run; load "
          f"average {r['loadavg_start'][0]:.2f} at start, {r['loadavg_end'][0]:.2f} at end")
    for target, met in r["meets_targets"].items():
        state = "n/a" if met is None else ("met" if met else "NOT met")
        extra = r["missed_targets"].get(target)
        note = f": {extra['measured']}; knob: {extra['knob']}" if extra else ""
        print(f"target {target}: {state}{note}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model(args.model_dir, layers=args.layers, dim=args.dim, n_ctx_train=args.n_ctx)
    workloads = [session_workload(args.agents, args.rounds, args.seed),
                 phase_shift_workload(args.agents, args.rounds, args.seed)]
    fixed = fixed_strategy(args.n_ctx)
    adaptive = adaptive_strategy(args.n_ctx)
    loadavg_start = os.getloadavg()
    load = BoxLoad()
    started = time.perf_counter()
    runs = interleaved_runs(model, workloads, fixed, adaptive, args.repeats)
    grid = None
    if not args.no_grid:
        phase_shift = workloads[1]
        configs = [static_strategy(threads, n_ctx) for threads in GRID_THREADS for n_ctx in GRID_N_CTX]
        reused = {s.name: "fixed" for s in configs if s.engine == fixed.engine and s.n_ctx == fixed.n_ctx}
        order = [s for s in configs if s.name not in reused]
        random.Random(args.seed).shuffle(order)
        print(f"grid on {phase_shift.name}: {', '.join(s.name for s in order)}"
              + (f" ({', '.join(reused)} = the fixed run)" if reused else ""), flush=True)
        for strategy in order:
            runs.append(measure(model, strategy, phase_shift, 0))
        grid = grid_report(runs, configs, reused, phase_shift.phases)
    wall_s = time.perf_counter() - started
    compared = {workload.name: compare(runs, workload.name) for workload in workloads}
    meets = targets_met(compared, grid)
    result: dict[str, Any] = {
        "benchmark": NAME, "quick": args.quick,
        "model": {"file": model.name, "layers": args.layers, "dim": args.dim, "dtype": "f16"},
        "n_ctx": args.n_ctx, "agents": args.agents, "rounds": args.rounds, "repeats": args.repeats,
        "seed": args.seed, "wall_s": wall_s,
        "workloads": {w.name: {"description": w.description, "phases": [asdict(p) for p in w.phases],
                               "input_tokens": [[t.input_tokens for t in row] for row in w.turns],
                               "max_tokens": [[t.max_tokens for t in row] for row in w.turns]} for w in workloads},
        "strategies": {s.name: {"label": s.label, "engine": s.engine, "n_ctx": s.n_ctx} for s in (fixed, adaptive)},
        "comparison": compared,
        "adaptive_choices": {w.name: adaptive_choices(runs, w.name) for w in workloads},
        "grid": grid,
        "memory_floor": memory_floor(model, args.n_ctx),
        "targets": {"peak_memory_lower_at_least": TARGET_PEAK_MEMORY_LOWER,
                    "ttft_p99_lower_at_least": TARGET_TTFT_P99_LOWER, "tokens_per_s_not_lower": 0.0,
                    "tokens_per_s_of_best_static_at_least": TARGET_OF_BEST_STATIC},
        "meets_targets": meets,
        "missed_targets": missed(meets, compared, grid),
        "complete": all(not run["errors"] for run in runs),
        "runs": runs,
        "box_load": load.figures(), "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(),
        "machine": machine(),
        "units": "ttft = first streamed text - request sent (client side), over every turn; tokens_per_s = "
                 "generated tokens / the rounds' wall time; peak_memory_bytes = VmHWM of the appliance process; "
                 "memory_growth_bytes = VmRSS at the end - VmRSS after round 1; improvement: positive = adaptive "
                 "better (lower times and memory, higher tokens/s)",
    }
    result["headline"] = headline(result)
    return result


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.agent_session", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run (4x256 model, 2 agents, 3 rounds, "
                                                        "no grid)")
    p.add_argument("--agents", type=int, default=None, help="agents at once (default 4; quick 2)")
    p.add_argument("--rounds", type=int, default=None, help="rounds per session (default 20; quick 3)")
    p.add_argument("--repeats", type=int, default=1, help="repetitions of fixed and adaptive, order alternated")
    p.add_argument("--layers", type=int, default=None, help="model layers (default 12; quick 4)")
    p.add_argument("--dim", type=int, default=None, help="model width (default 768; quick 256)")
    p.add_argument("--n-ctx", type=int, default=4096, help="the model's n_ctx (and n_ctx_train)")
    p.add_argument("--seed", type=int, default=0, help="the workload's seed")
    p.add_argument("--no-grid", action="store_true", default=None, help="skip the static grid")
    add_output_args(p, NAME)
    args = p.parse_args(argv)
    fill_defaults(args, full={"agents": 4, "rounds": 20, "layers": 12, "dim": 768, "no_grid": False},
                  quick={"agents": 2, "rounds": 3, "layers": 4, "dim": 256, "no_grid": True})
    if min(args.agents, args.repeats) < 1 or args.rounds < 2:
        p.error("--agents and --repeats must be >= 1, --rounds >= 2 (the phase-shift run has two phases)")
    needed = DOCUMENT_PHASE_INPUT[1] + LONG_OUTPUT + ROLLOVER_MARGIN
    if args.n_ctx < max(needed, max(GRID_N_CTX) if not args.no_grid else 0):
        p.error(f"--n-ctx must hold one turn ({needed} tokens) and the grid's largest n_ctx")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    return finish(result, args.out, print_table, ok=result["complete"])


if __name__ == "__main__":
    raise SystemExit(main())
