"""Grammar-constrained sampling in a batch (issue 22): what one sequence's grammar costs the others, and what it costs
to build a grammar sampler for a request with 10 tools.

Four sequences are decoded together in one :class:`~appliance.engine.batched.BatchedContext` (greedy, 64 tokens
each, short prompts), on the same model, twice per round and interleaved (the order alternates), so the box's noise
hits both alike:

* **plain**: no grammar;
* **one grammar**: sequence 0 samples under the grammar of a 10-tool request (``tool_choice: required``, Hermes'
  format, from :mod:`appliance.engine.toolcalls`; a JSON-schema grammar of a 10-function union when that module is
  missing), the three others as in the plain run.

Each step's time is counted only while all four sequences generate (the grammar sequence may finish early), so the
figures compare steps of the same batch: the three others' tokens/s with one grammar beside them over their tokens/s
without (the ratio; 1.0 = the grammar costs the others nothing), and the grammar sequence's own. Medians over the
rounds. The build time is llama.cpp's parse of the grammar (a model keeps the last parses) and the copy each sequence
gets.

The grammar's cost grows with the vocabulary (the grammar checks candidate tokens' texts): ``--vocab`` takes a
model's tokenizer from a GGUF (such as llama.cpp's vocab-only ``ggml-vocab-qwen2.gguf``, 151,936 tokens; ``python
tests/vendored.py`` prints the folder where the test suite keeps them); without it the tiny model's own small
vocabulary. ``python -m benchmarks.grammar``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import llama_cpp

from appliance.engine.batched import BatchedContext, ModelWeights
from appliance.engine.interface import GREEDY, Grammar, Sampling
from appliance.engine.tinymodel import write_tiny_model
from benchmarks.common import add_output_args, default_threads, fill_defaults, finish, machine

FULL = {"layers": 12, "dim": 768, "tokens": 64, "rounds": 3}
QUICK = {"layers": 2, "dim": 128, "tokens": 12, "rounds": 1}
SEQUENCES = 4
PROMPTS = ("Call a tool for the weather in Paris.", "Hello world the story", "once upon a time there was a model",
           "the water is hot today")
N_TOOLS = 10
PARAMETERS = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                               "unit": {"enum": ["c", "f"]},
                                               "tags": {"type": "array", "items": {"type": "string"}}},
              "required": ["city", "days"]}


def tool_grammar() -> tuple[Grammar, str]:
    """The grammar of a 10-tool request, and where it came from."""
    tools = [{"type": "function", "function": {"name": f"tool_{i}", "description": f"tool number {i}",
                                               "parameters": PARAMETERS}} for i in range(N_TOOLS)]
    try:
        from appliance.engine import toolcalls
    except ImportError:
        from llama_cpp.llama_grammar import json_schema_to_gbnf

        union = {"oneOf": [{"type": "object", "properties": {"name": {"const": f"tool_{i}"},
                                                             "arguments": PARAMETERS},
                            "required": ["name", "arguments"]} for i in range(N_TOOLS)]}
        return Grammar(json_schema_to_gbnf(json.dumps(union))), "llama_cpp json_schema_to_gbnf (10-function union)"
    grammar = toolcalls.grammar(toolcalls.HERMES, toolcalls.parse_tools(tools), "required", parallel=False)
    assert grammar is not None
    return grammar, "appliance.engine.toolcalls (hermes, tool_choice required)"


def bench_model(model_dir: Path, layers: int, dim: int, vocab: Path | None) -> Path:
    """The cached model: the tiny model's shape, with ``vocab``'s tokenizer when given (its name in the file name)."""
    label = "tiny" if vocab is None else f"vocab-{vocab.stem.removeprefix('ggml-vocab-')}"
    path = model_dir / f"{label}-{layers}x{dim}-f16-ctx2048-s0.gguf"
    if not path.is_file():
        write_tiny_model(path, layers=layers, dim=dim, seed=0, vocab_from=vocab)
    return path


def decode(weights: ModelWeights, prompts: list[list[int]], samplings: list[Sampling], tokens: int,
           threads: int) -> dict[str, float]:
    """One batched run: the steps' time while all sequences generate, and the tokens each made meanwhile."""
    with BatchedContext(weights, n_ctx=2048, n_seq_max=SEQUENCES, n_batch=256, n_threads=threads) as context:
        for seq_id, (prompt, sampling) in enumerate(zip(prompts, samplings, strict=True)):
            context.add(seq_id, prompt, sampling, tokens)
        seconds = 0.0
        counted = [0] * SEQUENCES
        finished: set[int] = set()
        while context.has_work():
            prefill = not any(context.generated(seq_id) for seq_id in range(SEQUENCES))
            started = time.perf_counter()
            events = context.step()
            elapsed = time.perf_counter() - started
            if prefill or finished:
                continue  # the prompts' step, and every step once a sequence ended, are not compared
            seconds += elapsed
            for event in events:
                counted[event.seq_id] += 1
                if event.done:
                    finished.add(event.seq_id)
    others = sum(counted[1:])
    return {"seconds": seconds, "grammar_tokens": counted[0], "other_tokens": others,
            "others_tokens_per_s": others / seconds if seconds else 0.0,
            "grammar_tokens_per_s": counted[0] / seconds if seconds else 0.0}


def build_times(weights: ModelWeights, grammar: Grammar, repeats: int) -> dict[str, float]:
    """Milliseconds to parse ``grammar`` for this vocabulary (uncached) and to copy it for one sequence."""
    parses = []
    copies = []
    for index in range(repeats):
        fresh = Grammar(grammar.gbnf + f"\nunused{index} ::= \"x\"")  # a new text: not a kept parse
        started = time.perf_counter()
        parts = weights.grammar_parts(fresh)
        parses.append(time.perf_counter() - started)
        started = time.perf_counter()
        copy = llama_cpp.llama_sampler_clone(parts.prototype)
        copies.append(time.perf_counter() - started)
        llama_cpp.llama_sampler_free(copy)
    return {"parse_ms": statistics.median(parses) * 1000, "copy_ms": statistics.median(copies) * 1000}


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = bench_model(args.model_dir, args.layers, args.dim, args.vocab)
    grammar, source = tool_grammar()
    with ModelWeights(model) as weights:
        prompts = [weights.tokenize(text, bos=True) for text in PROMPTS]
        constrained = [Sampling(grammar=grammar)] + [GREEDY] * (SEQUENCES - 1)
        plain = [GREEDY] * SEQUENCES
        rounds: list[dict[str, Any]] = []
        for index in range(args.rounds):
            order = ("plain", "grammar") if index % 2 == 0 else ("grammar", "plain")
            measured = {}
            for name in order:
                measured[name] = decode(weights, prompts, plain if name == "plain" else constrained, args.tokens,
                                        args.threads)
            ratio = measured["grammar"]["others_tokens_per_s"] / measured["plain"]["others_tokens_per_s"]
            rounds.append({"order": list(order), **measured, "ratio": ratio})
        build = build_times(weights, grammar, max(3, args.rounds))
        n_vocab = weights.n_vocab
    ratio = statistics.median(r["ratio"] for r in rounds)
    plain_tps = statistics.median(r["plain"]["others_tokens_per_s"] for r in rounds)
    grammar_tps = statistics.median(r["grammar"]["others_tokens_per_s"] for r in rounds)
    own_tps = statistics.median(r["grammar"]["grammar_tokens_per_s"] for r in rounds)
    plain_own = statistics.median(r["plain"]["grammar_tokens_per_s"] for r in rounds)
    headline = (f"HEADLINE: grammar {args.layers}x{args.dim} f16, {n_vocab}-token vocabulary, {SEQUENCES} sequences: "
                f"the 3 others {grammar_tps:.0f} tok/s beside one grammar vs {plain_tps:.0f} without ({ratio:.2f}x); "
                f"the grammar sequence {own_tps:.0f} tok/s ({own_tps / plain_own if plain_own else 0:.2f}x); "
                f"{N_TOOLS}-tool grammar built in {build['parse_ms']:.1f} ms, copied per sequence in "
                f"{build['copy_ms'] * 1000:.0f} us")
    return {"name": "grammar", "machine": machine(),
            "model": {"layers": args.layers, "dim": args.dim, "dtype": "f16", "n_vocab": n_vocab,
                      "vocab": None if args.vocab is None else args.vocab.name},
            "threads": args.threads, "tokens": args.tokens, "rounds": rounds, "grammar_source": source,
            "grammar_bytes": len(grammar.gbnf), "ratio": ratio, "others_tokens_per_s": {"plain": plain_tps,
                                                                                      "grammar": grammar_tps},
            "grammar_sequence_tokens_per_s": {"plain": plain_own, "grammar": own_tps}, "build": build,
            "headline": headline}


def print_table(result: dict[str, Any]) -> None:
    print(f"{'round':<7}{'order':<16}{'others tok/s plain':>20}{'others tok/s grammar':>22}{'ratio':>8}"
          f"{'grammar seq tok/s':>19}")
    for index, row in enumerate(result["rounds"]):
        print(f"{index:<7}{'/'.join(row['order']):<16}{row['plain']['others_tokens_per_s']:>20.1f}"
              f"{row['grammar']['others_tokens_per_s']:>22.1f}{row['ratio']:>8.2f}"
              f"{row['grammar']['grammar_tokens_per_s']:>19.1f}")
    build = result["build"]
    print(f"grammar ({result['grammar_source']}, {result['grammar_bytes']} bytes): parse {build['parse_ms']:.2f} ms, "
          f"copy {build['copy_ms'] * 1000:.0f} us")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.grammar", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a seconds-long smoke run on a tiny model")
    p.add_argument("--layers", type=int)
    p.add_argument("--dim", type=int)
    p.add_argument("--tokens", type=int, help="tokens each sequence generates")
    p.add_argument("--rounds", type=int, help="interleaved plain/grammar rounds (medians)")
    p.add_argument("--vocab", type=Path, help="a GGUF whose tokenizer the model takes (default: the tiny one's)")
    p.add_argument("--threads", type=int, default=default_threads())
    add_output_args(p, "grammar")
    args = p.parse_args(argv)
    fill_defaults(args, FULL, QUICK)
    result = run(args)
    return finish(result, Path(args.out), print_table)


if __name__ == "__main__":
    sys.exit(main())
