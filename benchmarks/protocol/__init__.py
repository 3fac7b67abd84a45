"""Protocol overhead: a direct library call vs the appliance over MAGN frames vs HTTP (SPEC B4, P1–P5).

One run, one tiny model (4 layers, 256 wide, f16), the same greedy requests (temperature 0) on every path:

* **in-process**: llama-cpp-python called directly (``Llama.create_completion``; the baseline), and the
  appliance's own engine (``Runtime.generate`` / ``detach`` of a fresh ``Conversation``, what a
  stateless request runs on the engine thread) and daemon core (``Daemon.complete`` in an event loop: the
  engine-thread hop and bookkeeping, no socket);
* **MAGN**: the appliance as ``python -m appliance run`` (its own process, like a real daemon), over its Unix
  socket, one persistent connection per client: the shipped blocking ``MagnClient``, ``AsyncMagnClient`` in one
  event loop, and a minimal blocking socket client built on the same codec (the floor for any client);
* **HTTP**: the appliance's own OpenAI endpoint when it has one (``/v1/completions``; probed, and the output
  says when it is missing), and llama-cpp-python's bundled ``llama_cpp.server`` (its own process, uvicorn),
  over one keep-alive ``httpx`` connection. When ``llama_cpp.server`` cannot be imported (its extras are not
  installed) or ``--no-http`` is given, the output says that it was skipped and why.

Every request is the same on every path: prompt -> 1 token, and prompt -> 64-token stream. Two prompts of equal
token length (different first word) alternate request by request, on every path alike: with one fixed prompt,
llama-cpp-python (and so ``llama_cpp.server``) answers a repeated 1-token request from its prefix cache without
decoding anything, which would compare a decode with no decode. The in-process library baseline calls
``Llama.reset()`` first, so it evaluates the whole prompt, like the appliance's stateless request;
``library_prefix`` (no reset, what ``llama_cpp.server`` does inside) only reuses the BOS cell.

Measurement is interleaved after a warm-up: each round visits the paths in a fresh random order, each path's turn
being a short pause (see :func:`rounds`) and a block of back-to-back requests, so a noisy machine hurts every path
alike; figures are medians. Overhead = median(path) - median(in-process library call). Correctness: every path's
greedy text must equal the library's for the same prompt (1 token and 64 tokens); the run exits 1 otherwise.

Run ``python -m benchmarks.protocol`` (``--quick`` for a seconds-long smoke run).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from benchmarks.common import add_output_args, default_threads, fill_defaults, finish
from benchmarks.protocol.report import NAME, print_table
from benchmarks.protocol.runner import run
from benchmarks.protocol.workload import PROMPTS

__all__ = ["PROMPTS", "main", "parse_args"]


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.protocol", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="20 1-token requests and 3 streams per path")
    p.add_argument("--requests", type=int, default=None, help="1-token requests per path (default 200; quick 20)")
    p.add_argument("--streams", type=int, default=None, help="64-token streams per path (default 30; quick 3)")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed 1-token requests per path first (default 30; quick 4), then 2 streams each")
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--no-http", action="store_true", help="skip the HTTP paths (no server is started)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--n-ctx", type=int, default=2048)
    p.add_argument("--threads", type=int, default=default_threads())
    add_output_args(p, NAME)
    args = p.parse_args(argv)
    fill_defaults(args, full={"requests": 200, "streams": 30, "warmup": 30},
                  quick={"requests": 20, "streams": 3, "warmup": 4})
    if args.requests < 1 or args.streams < 1 or args.warmup < 1 or args.stream_tokens < 2:
        p.error("--requests, --streams and --warmup must be >= 1, --stream-tokens >= 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    return finish(result, args.out, print_table, ok=result["texts_match"])
