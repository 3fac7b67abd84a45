"""Shared prefixes (SPEC L10): time to first token for a new agent whose prompt starts with a long system prompt
that another agent's live conversation already holds, with and without reuse.

Both paths run in-process on the same :class:`~appliance.engine.runtime.Runtime` (the engine the daemon drives),
interleaved, so the box's noise hits them alike:

* **without reuse**: the model's context holds nothing else; the new agent's whole prompt is evaluated;
* **with reuse**: a first agent's conversation holds the system prompt (its request ended; its cells rest in the
  context); the new agent shares those cells (``llama_memory_seq_cp``) and evaluates only its own question.

The two answers must be equal (greedy): the shared cells are the ones the prompt would have computed.

Target (issue #11): at least 5x lower time to first token with reuse. ``python -m benchmarks.prefix``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from appliance.engine.interface import GREEDY, Conversation
from appliance.engine.runtime import Runtime
from benchmarks.common import add_output_args, default_threads, fill_defaults, finish, machine, tiny_model

FULL = {"layers": 12, "dim": 768, "system_tokens": 1000, "repeats": 5, "n_ctx": 2048}
QUICK = {"layers": 2, "dim": 128, "system_tokens": 200, "repeats": 2, "n_ctx": 512}
TARGET = 5.0
QUESTION = "\nQuestion {index}: what does the story say about the water?"


def system_prompt(runtime: Runtime, tokens: int) -> str:
    """A system prompt of about ``tokens`` tokens of the model's vocabulary."""
    words = "You are a careful assistant. Answer from the story of a model and its memory. "
    text = words
    while len(runtime.tokenize(text, bos=True)) < tokens:
        text += words
    return text


def first_token(runtime: Runtime, prompt: str) -> tuple[float, str, int]:
    """A new conversation's time to first token, its 8-token answer and the tokens it evaluated."""
    conv = Conversation()
    generation = runtime.generate(conv, prompt, 8, GREEDY)
    runtime.detach(conv)
    assert generation.ttft_s is not None and generation.prompt_evaluated is not None
    return generation.ttft_s, generation.text, generation.prompt_evaluated


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model(args.model_dir, layers=args.layers, dim=args.dim, dtype="f16", n_ctx_train=4096)
    runtime = Runtime(model, n_ctx=args.n_ctx, n_gpu_layers=0, n_threads=args.threads, live_slots=2)
    try:
        system = system_prompt(runtime, args.system_tokens)
        cold: list[float] = []
        warm: list[float] = []
        cold_evaluated = warm_evaluated = 0
        same = True
        for index in range(args.repeats):
            prompt = system + QUESTION.format(index=index)
            ttft, cold_text, cold_evaluated = first_token(runtime, prompt)  # nothing live to share
            cold.append(ttft)
            holder = Conversation()
            runtime.generate(holder, system + QUESTION.format(index=index + 1000), 1, GREEDY)
            ttft, warm_text, warm_evaluated = first_token(runtime, prompt)  # shares the holder's cells
            warm.append(ttft)
            runtime.detach(holder)
            same = same and cold_text == warm_text
        prompt_tokens = len(runtime.tokenize(system + QUESTION.format(index=0), bos=True))
    finally:
        runtime.close()
    cold_ms = statistics.median(cold) * 1000
    warm_ms = statistics.median(warm) * 1000
    ratio = cold_ms / warm_ms if warm_ms > 0 else float("inf")
    headline = (f"HEADLINE: prefix {args.layers}x{args.dim} f16, {prompt_tokens}-token prompt: time to first token "
                f"{warm_ms:.1f} ms with a shared {args.system_tokens}-token system prompt vs {cold_ms:.1f} ms without "
                f"({ratio:.1f}x lower, target {TARGET:g}x); answers {'equal' if same else 'DIFFER'}")
    return {"name": "prefix", "machine": machine(), "model": {"layers": args.layers, "dim": args.dim, "dtype": "f16",
                                                              "n_ctx": args.n_ctx},
            "threads": args.threads, "repeats": args.repeats, "prompt_tokens": prompt_tokens,
            "system_tokens": args.system_tokens,
            "without_reuse": {"ttft_ms": [t * 1000 for t in cold], "median_ttft_ms": cold_ms,
                              "prompt_evaluated": cold_evaluated},
            "with_reuse": {"ttft_ms": [t * 1000 for t in warm], "median_ttft_ms": warm_ms,
                           "prompt_evaluated": warm_evaluated},
            "ratio": ratio, "target": TARGET, "answers_equal": same, "headline": headline}


def print_table(result: dict[str, Any]) -> None:
    print(f"{'path':<16}{'TTFT median ms':>16}{'tokens evaluated':>18}")
    for key in ("without_reuse", "with_reuse"):
        row = result[key]
        print(f"{key.replace('_', ' '):<16}{row['median_ttft_ms']:>16.1f}{row['prompt_evaluated']:>18}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.prefix", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run on a tiny model")
    p.add_argument("--layers", type=int)
    p.add_argument("--dim", type=int)
    p.add_argument("--system-tokens", type=int)
    p.add_argument("--repeats", type=int)
    p.add_argument("--n-ctx", type=int)
    p.add_argument("--threads", type=int, default=default_threads())
    add_output_args(p, "prefix")
    args = p.parse_args(argv)
    fill_defaults(args, FULL, QUICK)
    result = run(args)
    return finish(result, Path(args.out), print_table, ok=result["answers_equal"])


if __name__ == "__main__":
    sys.exit(main())
