"""Flash attention off against on (``engine.flash_attention``), side by side in one run: the aggregate decode speed of
8 sequences decoded together and the time to park one of them (copy its KV state out, as the engine does when it
parks a conversation), on the 12x768 f16 tiny model, 2 threads.

Each round builds one context per setting (alternating which goes first) and runs the same work in both: 8 prompts of
PROMPT tokens prefilled together, then the timed steps of one token per sequence, then each sequence's
state copied out (``state_into``, the engine's park) while the other 7 stay. The figures are the medians over the
rounds; the headline gives on/off ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from appliance.engine.batched import BatchedContext, ModelWeights
from appliance.engine.interface import GREEDY
from benchmarks.common import BoxLoad, add_output_args, fill_defaults, finish, machine, tiny_model

FULL: dict[str, Any] = {"layers": 12, "dim": 768, "rounds": 5, "decode_steps": 64}
QUICK: dict[str, Any] = {"layers": 2, "dim": 128, "rounds": 1, "decode_steps": 4}
MODES = ("off", "on")
SEQUENCES = 8
PROMPT = 64
"""Prompt tokens of each sequence; with the generated ones a sequence holds PROMPT + decode steps cells when it is
parked (128 in the full run)."""
N_CTX = 2048
N_BATCH = 512
THREADS = 2
FIRST_TOKEN = 3
"""Prompt tokens are drawn from ids FIRST_TOKEN.. (past the tiny vocabulary's special tokens)."""


def prompt(n_vocab: int, salt: int) -> list[int]:
    return [FIRST_TOKEN + (salt * 7919 + i * 104729) % (n_vocab - FIRST_TOKEN) for i in range(PROMPT)]


def measure(weights: ModelWeights, mode: str, decode_steps: int) -> dict[str, Any]:
    """One round of one setting: the decode speed of SEQUENCES together and each sequence's park time."""
    with BatchedContext(weights, n_ctx=N_CTX, n_seq_max=SEQUENCES, n_batch=N_BATCH, n_threads=THREADS,
                        flash_attn=mode) as context:
        for seq_id in range(SEQUENCES):
            context.add(seq_id, prompt(weights.n_vocab, seq_id), GREEDY, decode_steps + 1)
        context.step()  # the prefill of all 8 prompts, each samples its first token
        started = time.perf_counter()
        for _ in range(decode_steps):
            events = context.step()
            if len(events) != SEQUENCES:
                raise RuntimeError(f"a timed step gave {len(events)} tokens, not {SEQUENCES}")
        decode_s = time.perf_counter() - started
        cells = [context.finish(seq_id) for seq_id in range(SEQUENCES)]  # each rests with its cells, as parked
        parks = []
        for seq_id in range(SEQUENCES):
            buffer = bytearray(context.state_size(seq_id))
            started = time.perf_counter()
            context.state_into(seq_id, buffer)
            parks.append(time.perf_counter() - started)
        return {"flash_attn": context.flash_attn, "tokens_per_s": SEQUENCES * decode_steps / decode_s,
                "park_ms": statistics.median(parks) * 1000, "state_bytes": len(buffer),
                "cells": cells[0]}


def headline(result: dict[str, Any]) -> str:
    off, on = result["modes"]["off"], result["modes"]["on"]
    return (f"HEADLINE: flash attention {result['model']['layers']}x{result['model']['dim']} f16, {THREADS} threads, "
            f"{SEQUENCES} sequences: decode {on['tokens_per_s']:.1f} vs {off['tokens_per_s']:.1f} tok/s on/off = "
            f"{result['ratios']['decode_on_vs_off']:.2f}x; park of one {off['cells']}-cell sequence "
            f"{on['park_ms']:.2f} vs {off['park_ms']:.2f} ms = {result['ratios']['park_off_vs_on']:.1f}x faster on; "
            f"other processes used {result['box']['other_processes_share_of_box']:.0%} of the box")


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model(args.model_dir, layers=args.layers, dim=args.dim)
    box = BoxLoad()
    load_before = os.getloadavg()
    rounds: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    with ModelWeights(model) as weights:
        for index in range(args.rounds):
            order = MODES if index % 2 == 0 else tuple(reversed(MODES))  # the box's noise hits both alike
            for mode in order:
                rounds[mode].append(measure(weights, mode, args.decode_steps))
            figures = ", ".join(f"{mode} {rounds[mode][-1]['tokens_per_s']:.1f} tok/s park "
                                f"{rounds[mode][-1]['park_ms']:.2f} ms" for mode in MODES)
            print(f"  round {index + 1} of {args.rounds}: {figures}", file=sys.stderr, flush=True)
    modes = {}
    for mode, measured in rounds.items():
        modes[mode] = {"flash_attn": measured[0]["flash_attn"],
                       "tokens_per_s": statistics.median(r["tokens_per_s"] for r in measured),
                       "park_ms": statistics.median(r["park_ms"] for r in measured),
                       "state_bytes": measured[0]["state_bytes"], "cells": measured[0]["cells"],
                       "rounds": measured}
    result = {"name": "flash_attention", "benchmark": "flash_attention", "quick": args.quick, "machine": machine(),
              "load_average": {"before": load_before, "after": os.getloadavg()}, "box": box.figures(),
              "model": {"layers": args.layers, "dim": args.dim, "dtype": "f16"}, "sequences": SEQUENCES,
              "prompt_tokens": PROMPT, "decode_steps": args.decode_steps, "threads": THREADS,
              "rounds": args.rounds, "modes": modes,
              "ratios": {"decode_on_vs_off": modes["on"]["tokens_per_s"] / modes["off"]["tokens_per_s"],
                         "park_off_vs_on": modes["off"]["park_ms"] / modes["on"]["park_ms"]}}
    result["headline"] = headline(result)
    return result


def print_table(result: dict[str, Any]) -> None:
    print(f"{'flash attention':<16}{'decode tok/s':>14}{'park ms':>10}{'state KiB':>11}")
    for mode, row in result["modes"].items():
        print(f"{mode:<16}{row['tokens_per_s']:>14.1f}{row['park_ms']:>10.2f}{row['state_bytes'] / 1024:>11.0f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.flash_attention", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run on a smaller model")
    p.add_argument("--layers", type=int)
    p.add_argument("--dim", type=int)
    p.add_argument("--rounds", type=int)
    p.add_argument("--decode-steps", type=int)
    add_output_args(p, "flash_attention")
    args = p.parse_args(argv)
    fill_defaults(args, FULL, QUICK)
    out = Path(args.out)
    result = run(args)
    return finish(result, out, print_table, ok=result["modes"]["on"]["flash_attn"] is True)


if __name__ == "__main__":
    sys.exit(main())
