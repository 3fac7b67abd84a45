"""KV swap cost against memory bandwidth (SPEC B4, L5).

One agent's 2k-token context on a 12-layer, 768-wide f16 model is evicted to host RAM and restored with
:meth:`appliance.engine.runtime.Runtime.park` / :meth:`appliance.engine.slots.Slots.restore`
(llama.cpp's per-sequence state API into a reusable host buffer). In the same run, interleaved round by
round so that a noisy machine hurts every contender alike, it times:

* a plain memory copy of the same number of bytes between two preallocated buffers (``numpy.copyto`` and
  ``ctypes.memmove``; the faster median is the baseline, which is the conservative choice);
* llama-cpp-python's own ``Llama.save_state()`` / ``Llama.load_state()`` of the same context.

An evict + restore moves the agent's KV bytes twice (device -> host, host -> device), so its bandwidth is
``2 * bytes / (save + restore)`` and is compared with one memcpy's ``bytes / time``; likewise for
llama-cpp-python with its own (whole-context) state size.

Correctness: the next greedy tokens (and the logits of the first) after an evict, another agent's decode and
a restore must equal those of an uninterrupted run from the same point.

Run ``python -m benchmarks.kv_swap`` (``--quick`` for a seconds-long smoke run on a small model).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import llama_cpp
import numpy as np

from appliance.engine.gguf_meta import read_model_shape
from appliance.engine.runtime import GREEDY, Conversation, Runtime, Token
from benchmarks.common import add_output_args, default_threads, fill_defaults, finish, machine, tiny_model

NAME = "kv_swap"
TARGET_PCT = 50.0
LOGIT_TOLERANCE = 1e-4
CHECK_TOKENS = 8
GB = 1e9


def median_ms(samples: Sequence[float]) -> float:
    return statistics.median(samples) * 1e3


def timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def random_tokens(n: int, n_vocab: int, seed: int) -> list[int]:
    """BOS then ``n - 1`` token ids drawn past the special tokens (0 unk, 1 bos, 2 eos)."""
    rng = np.random.default_rng(seed)
    return [1, *(int(t) for t in rng.integers(3, n_vocab, n - 1))]


def last_logits(rt: Runtime, conv: Conversation) -> np.ndarray:
    """The logits ``conv`` sampled its last token from (in the step that sampled it)."""
    assert rt.context is not None and conv.seq is not None
    return rt.context.logits(conv.seq)


def continue_greedy(rt: Runtime, conv: Conversation, n: int) -> tuple[list[int], np.ndarray, bool]:
    """Generate ``n`` greedy tokens for ``conv``; return them, the logits behind the first, and whether its state
    came back from host RAM."""
    first: list[np.ndarray] = []

    def on_token(tok: Token) -> None:
        if tok.index == 0:
            first.append(last_logits(rt, conv))

    request = rt.begin(conv, "", n, GREEDY, on_token=on_token)
    if request is None:
        raise RuntimeError("no free sequence")
    while not request.done:
        rt.step()
    if request.error is not None:
        raise request.error
    if not first:
        raise RuntimeError("generation produced no token")
    return list(request.out), first[0], request.restored


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model(args.model_dir, layers=args.layers, dim=args.dim, dtype="f16", n_ctx_train=8192)
    shape = read_model_shape(model)
    rt = Runtime(model, n_ctx=args.n_ctx, n_gpu_layers=args.n_gpu_layers, n_threads=args.threads, live_slots=1)
    try:
        return measure(rt, args, model, shape.weight_bytes)
    finally:
        rt.close()


def measure(rt: Runtime, args: argparse.Namespace, model: Path, weight_bytes: int) -> dict[str, Any]:
    n_vocab = rt.weights.n_vocab
    if args.tokens + 1 + CHECK_TOKENS > rt.n_ctx:
        raise SystemExit(f"--tokens {args.tokens} needs n_ctx >= {args.tokens + 1 + CHECK_TOKENS}")
    assert rt.context is not None

    # Agent A fills its context: `tokens` prompt tokens evaluated, one token sampled.
    a = Conversation(tokens=random_tokens(args.tokens, n_vocab, seed=1))
    prefill_s = timed(lambda: rt.generate(a, "", 1, GREEDY))
    if a.seq is None or rt.context.cells(a.seq) != args.tokens:
        raise RuntimeError(f"expected {args.tokens} evaluated tokens")

    # Snapshot A (its resting sequence's state copied; the cells stay), then the uninterrupted reference.
    snapshot = rt.context.state(a.seq)
    snap_tokens, snap_evaluated = list(a.tokens), rt.context.cells(a.seq)
    ref_tokens, ref_logits, restored = continue_greedy(rt, a, CHECK_TOKENS)
    if restored:
        raise RuntimeError("the reference run went through a restore")
    rt.detach(a)

    # Another agent decodes in between, then A2 = A at the snapshot comes back through restore.
    b = Conversation(tokens=random_tokens(min(300, args.tokens), n_vocab, seed=2))
    rt.generate(b, "", 1, GREEDY)
    a2 = Conversation(tokens=snap_tokens, n_evaluated=snap_evaluated, where="host",
                      buffer=bytearray(snapshot), nbytes=len(snapshot))
    if not rt.slots.restore(a2) or a2.where != "device":
        raise RuntimeError("the parked conversation was not restored")
    kv_bytes = a2.nbytes

    # llama-cpp-python's own whole-context state calls, on the same model and prompt, for comparison.
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=args.n_ctx, n_threads=args.threads,
                          n_batch=min(512, args.n_ctx), n_gpu_layers=args.n_gpu_layers, seed=0, verbose=False)
    llm.eval(snap_tokens[:snap_evaluated])

    # Timing rounds, interleaved: memcpy, llama-cpp-python save/load_state, ours (last, so the KV that the
    # correctness check below resumes from went through our path).
    src = np.full(kv_bytes, 0x5A, dtype=np.uint8)
    dst = np.zeros(kv_bytes, dtype=np.uint8)
    np.copyto(dst, src)  # touch every page before timing
    cp_numpy: list[float] = []
    cp_memmove: list[float] = []
    lcp_save: list[float] = []
    lcp_load: list[float] = []
    ours_save: list[float] = []
    ours_restore: list[float] = []
    lcp_state_bytes = 0
    try:
        for _ in range(args.repeats):
            cp_numpy.append(timed(lambda: np.copyto(dst, src)))
            cp_memmove.append(timed(lambda: ctypes.memmove(dst.ctypes.data, src.ctypes.data, kv_bytes)))

            start = time.perf_counter()
            state = llm.save_state()
            lcp_save.append(time.perf_counter() - start)
            lcp_load.append(timed(lambda s=state: llm.load_state(s)))
            lcp_state_bytes = int(state.llama_state_size)
            del state

            ours_save.append(timed(lambda: rt.park(a2)))
            ours_restore.append(timed(lambda: rt.slots.restore(a2)))
            if a2.nbytes != kv_bytes or a2.seq is None or rt.context.cells(a2.seq) != snap_evaluated:
                raise RuntimeError("a save/restore cycle changed the conversation's size")
    finally:
        llm.close()

    # Correctness: park A2 for B (which decodes again), restore A2, continue greedily.
    rt.park(a2)
    rt.generate(b, "", 1, GREEDY)
    resumed_at = a2.n_evaluated
    got_tokens, got_logits, restored = continue_greedy(rt, a2, CHECK_TOKENS)
    logit_diff = float(np.max(np.abs(got_logits - ref_logits)))
    tokens_equal = got_tokens == ref_tokens
    correct = bool(restored and resumed_at == snap_evaluated and tokens_equal
                   and logit_diff <= LOGIT_TOLERANCE)

    memcpy_ms = min(median_ms(cp_numpy), median_ms(cp_memmove))
    memcpy_gbs = kv_bytes / (memcpy_ms / 1e3) / GB
    ours_ms = statistics.median(s + r for s, r in zip(ours_save, ours_restore, strict=True)) * 1e3
    ours_gbs = 2 * kv_bytes / (ours_ms / 1e3) / GB
    lcp_ms = statistics.median(s + r for s, r in zip(lcp_save, lcp_load, strict=True)) * 1e3
    lcp_gbs = 2 * lcp_state_bytes / (lcp_ms / 1e3) / GB
    ours_pct = 100 * ours_gbs / memcpy_gbs
    lcp_pct = 100 * lcp_gbs / memcpy_gbs

    ctx_label = f"{args.tokens // 1000}k" if args.tokens % 1000 == 0 else str(args.tokens)
    headline = (f"HEADLINE: kv_swap {ctx_label} ctx {args.layers}x{args.dim} f16: evict+restore {ours_ms:.1f} ms, "
                f"{ours_gbs:.2f} GB/s = {ours_pct:.0f}% of memcpy "
                f"(llama-cpp-python save/load_state: {lcp_pct:.0f}%), "
                f"resumed tokens {'match' if correct else 'DIFFER'}")
    return {
        "benchmark": NAME,
        "quick": args.quick,
        "model": {"file": model.name, "layers": args.layers, "dim": args.dim, "dtype": "f16",
                  "weight_bytes": weight_bytes},
        "n_ctx": rt.n_ctx,
        "n_gpu_layers": args.n_gpu_layers,
        "gpu_offload": bool(llama_cpp.llama_supports_gpu_offload()),  # False: the layers ran on the CPU whatever asked
        "context_tokens": args.tokens,
        "threads": args.threads,
        "repeats": args.repeats,
        "prefill_ms": prefill_s * 1e3,
        "kv_bytes": kv_bytes,
        "ours": {"save_ms": median_ms(ours_save), "restore_ms": median_ms(ours_restore),
                 "evict_restore_ms": ours_ms, "bytes_moved": 2 * kv_bytes, "gb_per_s": ours_gbs,
                 "pct_of_memcpy": ours_pct},
        "memcpy": {"bytes": kv_bytes, "numpy_copyto_ms": median_ms(cp_numpy),
                   "ctypes_memmove_ms": median_ms(cp_memmove), "ms": memcpy_ms, "gb_per_s": memcpy_gbs},
        "llama_cpp_python": {"state_bytes": lcp_state_bytes, "save_state_ms": median_ms(lcp_save),
                             "load_state_ms": median_ms(lcp_load), "save_load_ms": lcp_ms,
                             "bytes_moved": 2 * lcp_state_bytes, "gb_per_s": lcp_gbs, "pct_of_memcpy": lcp_pct},
        "correctness": {"reference_tokens": ref_tokens, "restored_tokens": got_tokens,
                        "tokens_equal": tokens_equal, "resumed_at_tokens": resumed_at,
                        "max_abs_logit_diff": logit_diff, "restore_correct": correct},
        "target_pct_of_memcpy": TARGET_PCT,
        "meets_target": ours_pct >= TARGET_PCT,
        "machine": machine(),
        "units": "ms are medians over the rounds; GB = 1e9 bytes",
        "headline": headline,
    }


def print_table(r: dict[str, Any]) -> None:
    ours, cp, lcp = r["ours"], r["memcpy"], r["llama_cpp_python"]
    print(f"model {r['model']['file']} ({r['model']['weight_bytes'] / 2**20:.0f} MiB weights), n_ctx {r['n_ctx']}, "
          f"{r['context_tokens']} tokens in context (prefill {r['prefill_ms'] / 1e3:.1f} s), "
          f"{r['threads']} threads, median of {r['repeats']} rounds")
    print(f"{'path':<34} {'bytes/dir':>12} {'out ms':>8} {'in ms':>8} {'total ms':>9} {'GB/s':>7} {'% memcpy':>9}")
    print(f"{'memcpy (best of numpy/memmove)':<34} {cp['bytes']:>12} {cp['ms']:>8.2f} {'':>8} {cp['ms']:>9.2f} "
          f"{cp['gb_per_s']:>7.2f} {100:>8.0f}%")
    print(f"{'appliance park/restore     ':<34} {r['kv_bytes']:>12} {ours['save_ms']:>8.2f} "
          f"{ours['restore_ms']:>8.2f} {ours['evict_restore_ms']:>9.2f} {ours['gb_per_s']:>7.2f} "
          f"{ours['pct_of_memcpy']:>8.0f}%")
    print(f"{'llama-cpp-python save/load_state':<34} {lcp['state_bytes']:>12} {lcp['save_state_ms']:>8.2f} "
          f"{lcp['load_state_ms']:>8.2f} {lcp['save_load_ms']:>9.2f} {lcp['gb_per_s']:>7.2f} "
          f"{lcp['pct_of_memcpy']:>8.0f}%")
    c = r["correctness"]
    print(f"resume check: reference {c['reference_tokens']} vs restored {c['restored_tokens']}, "
          f"max |logit diff| {c['max_abs_logit_diff']:.3g} -> {'OK' if c['restore_correct'] else 'FAILED'}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kv_swap", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small model (2x128) and 200-token context, 5 rounds")
    p.add_argument("--layers", type=int, default=None, help="model layers (default 12; quick 2)")
    p.add_argument("--dim", type=int, default=None, help="model width (default 768; quick 128)")
    p.add_argument("--tokens", type=int, default=None, help="context tokens to swap (default 2000; quick 200)")
    p.add_argument("--n-ctx", type=int, default=None, help="context size (default 2048; quick 256)")
    p.add_argument("--repeats", type=int, default=None, help="timing rounds (default 15; quick 5)")
    p.add_argument("--threads", type=int, default=default_threads())
    p.add_argument("--n-gpu-layers", type=int, default=0,
                   help="layers offloaded to the GPU (-1 = all; needs a CUDA build of llama-cpp-python): the swap then "
                        "copies the KV cache between VRAM and host RAM (default 0: CPU)")
    add_output_args(p, NAME)
    args = p.parse_args(argv)
    fill_defaults(args, full={"layers": 12, "dim": 768, "tokens": 2000, "n_ctx": 2048, "repeats": 15},
                  quick={"layers": 2, "dim": 128, "tokens": 200, "n_ctx": 256, "repeats": 5})
    if args.repeats < 1 or args.tokens < 2:
        p.error("--repeats must be >= 1 and --tokens >= 2")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    return finish(result, args.out, print_table, ok=result["correctness"]["restore_correct"])


if __name__ == "__main__":
    sys.exit(main())
