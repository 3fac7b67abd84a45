"""Admission: three models on a fake 8 GiB device, appliance vs naive one-process-per-model (SPEC B4, L2-L5).

Three real (tiny, random-weight) GGUF files are written whose KV geometry (layers, KV heads, head size) and
training context (``n_ctx_train``) are those of typical 0.5B / 1.5B / 7B-class GQA chat models. Their shapes
are read back from the files with :func:`appliance.engine.gguf_meta.read_model_shape` and every KV figure comes from
the real estimator (:func:`appliance.engine.gguf_meta.estimate`). A tiny file's own weights are a few MiB, so each
model's weight bytes are *declared* instead (an operator-given figure, as SPEC L2 allows: roughly a Q4_K_M
file of that size class). The output labels every figure as measured (from the files) or declared.

* Naive: every agent is its own server process that loads its own copy of the weights and preallocates KV for
  the model's full training context, plus a declared per-process runtime overhead (CUDA context, allocator
  slack). Processes are placed first-fit, round-robin over the models (smallest process first), on the whole
  device (no admission headroom). Reported for one process per model and for one process per agent.
* Appliance: one process (charged the same runtime overhead once, through the ledger), cap = admission_percent
  of the device (:func:`appliance.daemon.ledger.compute_cap`), each model reserved once through the real
  :meth:`appliance.daemon.ledger.Ledger.try_reserve` at its configured ``n_ctx``; all agents of an admitted model share
  the loaded weights and its context, suspended agents' KV parked in host RAM (SPEC L4, L5).

Run ``python -m benchmarks.admission`` (``--quick`` runs the same computation: it is fast already).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from appliance.daemon.devices import FakeDevice, parse_size
from appliance.daemon.ledger import Ledger, compute_cap
from appliance.engine.gguf_meta import Estimate, ModelShape, estimate, kv_bytes, read_model_shape
from appliance.errors import ApplianceError
from benchmarks.common import add_output_args, finish, tiny_model

NAME = "admission"
GIB = 2**30
MIB = 2**20
RUNTIME_KEY = "(runtime overhead)"


@dataclass(frozen=True)
class ModelDecl:
    """One model: the shape written into its tiny GGUF, and its declared (operator-given) weight bytes."""

    name: str
    layers: int
    dim: int
    heads: int
    kv_heads: int
    n_ctx_train: int
    weights: str  # declared, a parse_size string
    size_class: str


MODELS: tuple[ModelDecl, ...] = (
    # dim = heads * head size; the KV cache only depends on layers, KV heads and head size, so a narrow feed-
    # forward (ff=64) keeps the files small without changing any KV figure.
    ModelDecl("small-0.5b", layers=24, dim=128, heads=2, kv_heads=2, n_ctx_train=32768, weights="400MiB",
              size_class="0.5B-class: 24 layers, 2 KV heads x 64"),
    ModelDecl("coder-1.5b", layers=28, dim=256, heads=2, kv_heads=2, n_ctx_train=32768, weights="920MiB",
              size_class="1.5B-class: 28 layers, 2 KV heads x 128"),
    ModelDecl("chat-7b", layers=32, dim=512, heads=4, kv_heads=4, n_ctx_train=32768, weights="4200MiB",
              size_class="7B-class: 32 layers, 4 KV heads x 128"),
)


def model_file(model_dir: Path, decl: ModelDecl) -> Path:
    return tiny_model(model_dir, layers=decl.layers, dim=decl.dim, heads=decl.heads, kv_heads=decl.kv_heads, ff=64,
                      n_ctx_train=decl.n_ctx_train, seed=7, label=f"adm-{decl.name}")


def gib(n: int) -> float:
    return n / GIB


def first_fit_round_robin(sizes: dict[str, int], per_model: int, capacity: int) -> dict[str, int]:
    """Place ``per_model`` processes of each model, round-robin over models (smallest process first), each
    where it still fits; return the number placed per model."""
    placed = dict.fromkeys(sizes, 0)
    used = 0
    order = sorted(sizes, key=lambda name: (sizes[name], name))
    for _ in range(per_model):
        for name in order:
            if used + sizes[name] <= capacity:
                used += sizes[name]
                placed[name] += 1
    return placed


def run(args: argparse.Namespace) -> dict[str, Any]:
    device = FakeDevice(args.device_size)
    total = device.read().total
    overhead = parse_size(args.process_overhead)
    cap = compute_cap(total, args.admission_percent)

    models: list[dict[str, Any]] = []
    shapes: dict[str, ModelShape] = {}
    for decl in MODELS:
        path = model_file(args.model_dir, decl)
        measured = read_model_shape(path)
        declared_weights = parse_size(decl.weights)
        shape = replace(measured, weight_bytes=declared_weights)
        shapes[decl.name] = shape
        naive_est = estimate(shape, measured.n_ctx_train)
        appl_est = estimate(shape, args.n_ctx)
        models.append({
            "name": decl.name,
            "size_class": decl.size_class,
            "file": path.name,
            "measured_from_file": {
                "layers": measured.layers, "n_head_kv": measured.n_head_kv, "head_dim_k": measured.head_dim_k,
                "head_dim_v": measured.head_dim_v, "n_ctx_train": measured.n_ctx_train,
                "file_bytes": measured.file_bytes, "tensor_bytes": measured.weight_bytes,
                "kv_bytes_per_token": kv_bytes(measured, 1),
            },
            "declared": {"weight_bytes": declared_weights, "n_ctx": args.n_ctx},
            "naive_estimate": asdict(naive_est),
            "naive_process_bytes": naive_est.total + overhead,
            "appliance_estimate": asdict(appl_est),
        })

    # Naive: processes on the whole device.
    sizes = {m["name"]: m["naive_process_bytes"] for m in models}
    one_each = first_fit_round_robin(sizes, 1, total)
    per_agent = first_fit_round_robin(sizes, args.agents_per_model, total)
    naive_models = sum(1 for n in per_agent.values() if n > 0)
    naive_agents = sum(per_agent.values())

    # Appliance: the real ledger, runtime overhead first, then each model once at its configured n_ctx.
    ledger = Ledger(cap)
    ledger.try_reserve(RUNTIME_KEY, overhead)
    for m in models:
        est: Estimate = Estimate(**m["appliance_estimate"])
        try:
            ledger.try_reserve(m["name"], est.total)
            m["appliance_admitted"] = True
        except ApplianceError as exc:
            if exc.code != "VRAM_LEDGER_DENY":
                raise
            m["appliance_admitted"] = False
            m["appliance_denial"] = exc.details
        m["naive_one_process_placed"] = one_each[m["name"]] == 1
        m["naive_agents_placed"] = per_agent[m["name"]]
    admitted = [m for m in models if m["appliance_admitted"]]
    appl_agents = args.agents_per_model * len(admitted)
    parked_host = sum(args.agents_per_model * m["appliance_estimate"]["kv"] for m in admitted)
    n_models, n_agents = len(models), args.agents_per_model * len(models)

    headline = (f"HEADLINE: admission on fake {gib(total):g} GiB: appliance placed {len(admitted)}/{n_models} models "
                f"({appl_agents}/{n_agents} agents), naive per-process placed {naive_models}/{n_models} models "
                f"({naive_agents}/{n_agents} agents)")
    return {
        "benchmark": NAME,
        "quick": args.quick,
        "device": {"kind": "fake", "total_bytes": total},
        "admission_percent": args.admission_percent,
        "cap_bytes": cap,
        "agents_per_model": args.agents_per_model,
        "declared": {
            "weight_bytes": "per model, operator-given (a tiny file's own tensors are far smaller)",
            "process_overhead_bytes": overhead,
            "n_ctx": args.n_ctx,
            "device_total_bytes": total,
        },
        "measured_from_files": "layers, KV heads, head sizes, n_ctx_train (hence every KV byte figure, through "
                               "appliance.engine.gguf_meta.estimate), file and tensor bytes",
        "models": models,
        "naive": {
            "capacity_bytes": total,
            "one_process_per_model": {"needed_bytes": sum(sizes.values()),
                                      "models_placed": sum(one_each.values())},
            "one_process_per_agent": {"processes_needed_bytes": args.agents_per_model * sum(sizes.values()),
                                      "models_placed": naive_models, "agents_placed": naive_agents},
        },
        "appliance": {"ledger_cap_bytes": cap, "ledger_allocated_bytes": ledger.allocated,
                      "reservations": ledger.reservations(), "models_placed": len(admitted),
                      "agents_placed": appl_agents, "parked_kv_host_bytes_max": parked_host},
        "headline": headline,
    }


def print_table(r: dict[str, Any]) -> None:
    d = r["declared"]
    print(f"fake device {gib(r['device']['total_bytes']):.2f} GiB; appliance cap {r['admission_percent']}% = "
          f"{gib(r['cap_bytes']):.2f} GiB; {r['agents_per_model']} agents per model; declared per-process runtime "
          f"overhead {d['process_overhead_bytes'] / MIB:.0f} MiB; appliance n_ctx {d['n_ctx']}")
    print("measured from the GGUF files: layers, KV heads x head size, n_ctx_train, KV/token; "
          "declared: weights, overhead, n_ctx")
    print(f"{'model':<11} {'layers':>6} {'kv':>7} {'ctx_train':>9} {'KV/tok':>8} {'weights*':>9} "
          f"{'naive proc':>10} {'appl. resv':>10} {'naive agents':>12} {'appliance':>9}")
    for m in r["models"]:
        f = m["measured_from_file"]
        print(f"{m['name']:<11} {f['layers']:>6} {f['n_head_kv']:>3}x{f['head_dim_k']:<3} {f['n_ctx_train']:>9} "
              f"{f['kv_bytes_per_token'] / 1024:>5.0f}KiB {gib(m['declared']['weight_bytes']):>7.2f}G "
              f"{gib(m['naive_process_bytes']):>9.2f}G {gib(m['appliance_estimate']['total']):>9.2f}G "
              f"{m['naive_agents_placed']:>6}/{r['agents_per_model']:<5} "
              f"{'admitted' if m['appliance_admitted'] else 'DENIED':>9}")
    print("(* declared; naive proc = weights + KV for n_ctx_train + compute margin + overhead; appl. resv = "
          "estimate at n_ctx)")
    n, a = r["naive"], r["appliance"]
    n_models = len(r["models"])
    print(f"naive, one process per model: needs {gib(n['one_process_per_model']['needed_bytes']):.2f} GiB of "
          f"{gib(n['capacity_bytes']):.2f} -> {n['one_process_per_model']['models_placed']}/{n_models} models")
    print(f"naive, one process per agent: {n['one_process_per_agent']['agents_placed']}/"
          f"{r['agents_per_model'] * n_models} agents, {n['one_process_per_agent']['models_placed']}/{n_models} "
          "models")
    print(f"appliance: ledger {gib(a['ledger_allocated_bytes']):.2f} of {gib(a['ledger_cap_bytes']):.2f} GiB -> "
          f"{a['models_placed']}/{n_models} models, {a['agents_placed']}/{r['agents_per_model'] * n_models} "
          f"agents; parked KV in host RAM at most {gib(a['parked_kv_host_bytes_max']):.2f} GiB")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.admission", description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="accepted for a uniform interface; the run is fast anyway")
    p.add_argument("--device-size", default="8GiB", help="fake device size (default 8GiB)")
    p.add_argument("--admission-percent", type=float, default=90.0, help="appliance admission cap (default 90)")
    p.add_argument("--n-ctx", type=int, default=8192, help="the appliance's configured context per model")
    p.add_argument("--agents-per-model", type=int, default=4)
    p.add_argument("--process-overhead", default="300MiB", help="declared runtime overhead per process")
    add_output_args(p, NAME)
    args = p.parse_args(argv)
    if args.agents_per_model < 1 or args.n_ctx < 1:
        p.error("--agents-per-model and --n-ctx must be positive")
    if args.admission_percent.is_integer():
        args.admission_percent = int(args.admission_percent)
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    return finish(run(args), args.out, print_table)


if __name__ == "__main__":
    sys.exit(main())
