"""Idle memory: the resident set of ``appliance run`` serving the demo model and doing nothing, beside llama.cpp's
``llama-server`` on the same file and, as the floor any Python server on llama-cpp-python starts from, a bare
``python -c "import asyncio, llama_cpp"``.

The model is the shipped config's demo model (4 layers x 256, f16, seed 0, ``n_ctx`` 2048: ``generate_if_missing``
in ``appliance.yaml``), written once into the model cache. Each start (``--starts``, medians over them; the
contenders alternate per start):

* **appliance**: ``python -m appliance run`` on a config like the shipped one (``device: auto``, default engine
  settings, the one demo model, its own state folder, socket and HTTP port): its resident set once ``/v1/health``
  answers (started, no model), then after one ``POST /v1/chat/completions`` of 4 tokens (the model loaded and warmed
  up) and ``--settle`` seconds of nothing;
* **llama-server** (``-np 1 -c 2048``, one ``/completion`` of 4 tokens, then the same settle; built by ``python -m
  benchmarks.peer build``; absent with a note when not built);
* **python floor**: the interpreter with ``asyncio`` and ``llama_cpp`` imported (which brings numpy), nothing else.

Figures come from ``/proc/<pid>/status``: ``VmRSS`` (resident now), ``RssAnon`` (heap: Python's objects, llama.cpp's
buffers), ``RssFile`` (mapped files: libraries and the model's weights) and ``VmHWM`` (the peak so far). Target: the
appliance's idle resident set with the model loaded at most ``--target-mib`` (60 MiB); the ratio to llama-server's
is shown beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from appliance.benchmark.servers import Process, free_port
from benchmarks import peer
from benchmarks.common import add_output_args, fill_defaults, finish, machine, tiny_model

MIB = 1024 * 1024
STATUS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "VmHWM")
DEMO = {"layers": 4, "dim": 256, "seed": 0}
N_CTX = 2048
MODEL_NAME = "demo"
FLOOR_CODE = "import asyncio, sys, llama_cpp; print('ready', flush=True); sys.stdin.read()"


def status_mib(pid: int) -> dict[str, float]:
    """The resident-set fields of ``/proc/<pid>/status``, in MiB."""
    found: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in STATUS_FIELDS:
            found[key] = int(rest.split()[0]) / 1024
    missing = [key for key in STATUS_FIELDS if key not in found]
    if missing:
        raise RuntimeError(f"/proc/{pid}/status has no {', '.join(missing)} line")
    return found


def post_json(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def answers(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as response:
        return bool(response.status == 200)


def appliance_config(model: Path, state: Path, port: int) -> str:
    """The shipped config's settings for the demo model alone, in ``state``, on ``port``."""
    return yaml.safe_dump({
        "data_dir": str(state), "device": "auto", "model_dirs": [str(model.parent)],
        "socket": {"path": str(state / "a.sock")}, "http": {"host": "127.0.0.1", "port": port},
        "log_level": "warning",
        "models": [{"name": MODEL_NAME, "path": str(model), "n_ctx": N_CTX}],
    }, sort_keys=False)


def measure_appliance(model: Path, settle_s: float) -> dict[str, Any]:
    state = Path(tempfile.mkdtemp(prefix="ap-idle-"))
    port = free_port()
    config = state / "appliance.yaml"
    config.write_text(appliance_config(model, state, port))
    base = f"http://127.0.0.1:{port}"
    proc = Process([sys.executable, "-m", "appliance", "run", "--config", str(config)], state / "appliance.log")
    try:
        proc.wait_until(lambda: answers(base + "/v1/health"), "appliance run")
        time.sleep(settle_s)
        started = status_mib(proc.proc.pid)
        reply = post_json(base + "/v1/chat/completions", {
            "model": MODEL_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4})
        if reply["usage"]["completion_tokens"] < 1:
            raise RuntimeError(f"the appliance generated nothing: {reply}")
        time.sleep(settle_s)
        loaded = status_mib(proc.proc.pid)
    finally:
        proc.stop()
    return {"started": started, "loaded": loaded}


def measure_llama_server(binary: Path, model: Path, threads: int, settle_s: float) -> dict[str, Any]:
    with peer.LlamaServer(binary, model, n_parallel=1, threads=threads, n_ctx=N_CTX) as server:
        reply = post_json(server.base_url + "/completion", {"prompt": "Hello", "n_predict": 4})
        if not reply.get("tokens_predicted"):
            raise RuntimeError(f"llama-server generated nothing: {reply}")
        time.sleep(settle_s)
        return {"loaded": status_mib(server.pid)}


def measure_floor(settle_s: float) -> dict[str, Any]:
    proc = subprocess.Popen([sys.executable, "-c", FLOOR_CODE], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError(f"the floor process exited with {proc.wait()}")
        time.sleep(settle_s)
        return {"loaded": status_mib(proc.pid)}
    finally:
        proc.kill()
        proc.wait()


def medians(samples: Sequence[dict[str, float]]) -> dict[str, float]:
    return {key: round(statistics.median(sample[key] for sample in samples), 1) for key in STATUS_FIELDS}


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model(args.model_dir, **DEMO)
    binaries = peer.built_binaries(args.peer_cache)
    raw: dict[str, list[dict[str, Any]]] = {"appliance": [], "python_floor": []}
    if binaries is not None:
        raw["llama_server"] = []
    for start in range(args.starts):
        order = list(raw)
        if start % 2:
            order.reverse()
        for name in order:
            if name == "appliance":
                raw[name].append(measure_appliance(model, args.settle))
            elif name == "llama_server":
                assert binaries is not None
                raw[name].append(measure_llama_server(binaries["llama-server"], model, args.threads, args.settle))
            else:
                raw[name].append(measure_floor(args.settle))
    summary = {name: {phase: medians([sample[phase] for sample in samples]) for phase in samples[0]}
               for name, samples in raw.items()}
    return report(args, model, raw, summary, binaries is not None)


def report(args: argparse.Namespace, model: Path, raw: dict[str, Any], summary: dict[str, Any],
           peer_built: bool) -> dict[str, Any]:
    ours = summary["appliance"]["loaded"]["VmRSS"]
    floor = summary["python_floor"]["loaded"]["VmRSS"]
    theirs = summary["llama_server"]["loaded"]["VmRSS"] if peer_built else None
    ratio = round(ours / theirs, 2) if theirs else None
    met = ours <= args.target_mib
    peer_text = f"llama-server {theirs:.1f} MiB ({ratio:.2f}x)" if theirs else "llama-server absent"
    headline = (f"HEADLINE: idle_memory demo model (4x256 f16, n_ctx {N_CTX}), median of {args.starts} starts: "
                f"appliance {ours:.1f} MiB resident with the model loaded "
                f"({summary['appliance']['started']['VmRSS']:.1f} MiB before it), {peer_text}, python + llama_cpp "
                f"floor {floor:.1f} MiB; target <= {args.target_mib:g} MiB: {'met' if met else 'not met'}")
    return {
        "benchmark": "idle_memory", "machine": machine(), "model": model.name, "n_ctx": N_CTX,
        "starts": args.starts, "settle_s": args.settle, "threads_llama_server": args.threads,
        "notes": {"llama_server": "built" if peer_built else
                  f"absent: llama.cpp is not built in {args.peer_cache or peer.default_cache()} "
                  f"(python -m benchmarks.peer build)"},
        "mib": summary, "raw_mib": raw, "ratio_to_llama_server": ratio,
        "target_mib": args.target_mib, "meets_target": met, "headline": headline,
    }


def print_table(r: dict[str, Any]) -> None:
    print(f"idle resident memory, {r['model']}, n_ctx {r['n_ctx']}, median of {r['starts']} starts, MiB")
    print(f"{'process':<14} {'phase':<8} " + " ".join(f"{key:>8}" for key in STATUS_FIELDS))
    for name, phases in r["mib"].items():
        for phase, figures in phases.items():
            print(f"{name:<14} {phase:<8} " + " ".join(f"{figures[key]:8.1f}" for key in STATUS_FIELDS))
    if r["ratio_to_llama_server"] is not None:
        print(f"appliance / llama-server (VmRSS, model loaded): {r['ratio_to_llama_server']:.2f}x")
    else:
        print(f"llama-server: {r['notes']['llama_server']}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="one start each, a short settle (a smoke run)")
    p.add_argument("--starts", type=int, default=None, help="starts of each process (default 3; quick 1)")
    p.add_argument("--settle", type=float, default=None, help="seconds of idling before a reading (default 3)")
    p.add_argument("--threads", type=int, default=2, help="llama-server's -t and -tb")
    p.add_argument("--target-mib", type=float, default=60.0, help="the appliance's idle target, MiB")
    p.add_argument("--peer-cache", type=Path, default=None, help="where llama-server is built (benchmarks.peer)")
    add_output_args(p, "idle_memory")
    args = p.parse_args(argv)
    fill_defaults(args, {"starts": 3, "settle": 3.0}, {"starts": 1, "settle": 0.5})
    if args.starts < 1:
        p.error("--starts must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    return finish(result, args.out, print_table)


if __name__ == "__main__":
    sys.exit(main())
