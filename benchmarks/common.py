"""What every benchmark script shares: where results and generated models go, the cached tiny models, the common
command-line options, the CPU other processes use meanwhile (over a whole run, :class:`BoxLoad`, and per round,
:func:`cpu_snapshot`, with the rounds they contaminate dropped and re-run: :func:`run_clean_rounds`), and the end of
a run (write the JSON, print the table, the path and the HEADLINE)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp

from appliance.benchmark.quality import cpu_use
from appliance.engine.tinymodel import write_tiny_model
from appliance.engine.tuning import parse_proc_stat

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_MODEL_DIR = Path(tempfile.gettempdir()) / "appliance-bench-models"
NOISY_SHARE = 0.05
"""A whole run during which other processes used more than this share of the box's CPU is NOISY (:class:`BoxLoad`)."""
FOREIGN_CPU_LIMIT = 0.10
"""A round during which other processes used more than this share of the box's CPU is dropped and re-run
(:func:`run_clean_rounds`)."""


def tiny_model(model_dir: Path, *, layers: int, dim: int, heads: int | None = None, kv_heads: int | None = None,
               ff: int | None = None, n_ctx_train: int = 2048, dtype: str = "f16", seed: int = 0,
               label: str = "tiny") -> Path:
    """The cached tiny model with these :func:`~appliance.engine.tinymodel.write_tiny_model` parameters, written
    (atomically) on first use. Every parameter is in the file name, so two shapes never share a cached file."""
    parts = [label, f"{layers}x{dim}"]
    if heads is not None or kv_heads is not None:
        parts.append(f"h{heads}kv{kv_heads}")
    if ff is not None:
        parts.append(f"ff{ff}")
    parts += [dtype, f"ctx{n_ctx_train}", f"s{seed}"]
    path = model_dir / ("-".join(parts) + ".gguf")
    if not path.is_file():
        write_tiny_model(path, layers=layers, dim=dim, heads=heads, kv_heads=kv_heads, ff=ff,
                         n_ctx_train=n_ctx_train, seed=seed, dtype=dtype)
    return path


@dataclass(frozen=True)
class ContextThreads:
    """The thread counts a llama.cpp context of the appliance's engine uses (llama-cpp-python's and
    ``llama_cpp.server``'s runs are given the same)."""

    n_threads: int
    n_threads_batch: int


def machine() -> dict[str, Any]:
    """The box a result was measured on."""
    return {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "llama_cpp_python": llama_cpp.__version__}


def default_threads() -> int:
    return max(1, min(4, os.cpu_count() or 1))


def add_output_args(p: argparse.ArgumentParser, name: str) -> None:
    """``--model-dir`` and ``--out``, the same for every script."""
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="cache of generated models")
    p.add_argument("--out", type=Path, default=RESULTS_DIR / f"{name}.json", help="where to write the JSON")


def fill_defaults(args: argparse.Namespace, full: Mapping[str, Any], quick: Mapping[str, Any]) -> None:
    """Options left unset (None) take the full run's default, or the ``--quick`` one."""
    for key, value in (quick if args.quick else full).items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def finish(result: dict[str, Any], out: Path, print_table: Callable[[dict[str, Any]], None], ok: bool = True) -> int:
    """Write ``result`` as JSON to ``out``, print its table, the path and its HEADLINE; the exit code (1: not ok)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    print(f"results: {out}")
    print(result["headline"])
    return 0 if ok else 1


class BoxLoad:
    """CPU time other processes used while a whole benchmark ran: every busy CPU second of the box (/proc/stat) less
    this process's and its reaped children's (the servers, llama-batched-bench). A shared box is noisy; this says
    how noisy."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.box_start = self._box_busy_s()
        self.own_start = self._own_s()

    @staticmethod
    def _box_busy_s() -> float:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle, iowait
        return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_s() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    def figures(self) -> dict[str, float]:
        wall = time.perf_counter() - self.start
        other = (self._box_busy_s() - self.box_start) - (self._own_s() - self.own_start)
        cpus = os.cpu_count() or 1
        return {"wall_s": wall, "other_processes_cpu_s": max(0.0, other),
                "other_processes_share_of_box": max(0.0, other) / (wall * cpus)}


@dataclass(frozen=True)
class CpuSnapshot:
    """One reading: the box's ``/proc/stat`` counters and the clock ticks the benchmark's own processes used so far
    (this process with its threads and reaped children, and the live servers it measures, with theirs)."""

    box: tuple[int, ...]
    own_ticks: int


def process_ticks(pid: int | str) -> int:
    """utime + stime + cutime + cstime of a live process (every thread, and the children it reaped), in clock
    ticks, from ``/proc/<pid>/stat``."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError as exc:
        raise RuntimeError(f"cannot read the CPU time of process {pid} (/proc/{pid}/stat: {exc}); a measured server "
                           f"is gone") from exc
    fields = text.rsplit(")", 1)[1].split()
    return sum(int(value) for value in fields[11:15])  # proc(5) fields 14-17


def cpu_snapshot(pids: Sequence[int]) -> CpuSnapshot:
    """A :class:`CpuSnapshot` with ``pids`` (the live servers) counted as the benchmark's own."""
    own = process_ticks("self") + sum(process_ticks(pid) for pid in pids)
    return CpuSnapshot(parse_proc_stat(Path("/proc/stat").read_text()), own)


def foreign_share(before: CpuSnapshot, after: CpuSnapshot) -> float | None:
    """The share (0 to 1) of the box's CPU other processes used between two snapshots; None when less than a clock
    tick passed (a round too short to tell)."""
    if sum(after.box) == sum(before.box):
        return None
    return cpu_use(before.box, after.box, max(0, after.own_ticks - before.own_ticks)).others_share


@dataclass(frozen=True)
class RoundRecord:
    """One attempted round: the CPU share other processes used during it (None: too short to measure), whether it
    was clean (at most the limit), whether its figures are kept, and why."""

    attempt: int
    foreign_share: float | None
    clean: bool
    kept: bool
    why: str

    def as_json(self) -> dict[str, Any]:
        return {"attempt": self.attempt, "foreign_share": self.foreign_share, "clean": self.clean, "kept": self.kept,
                "why": self.why}


def is_clean(share: float | None, limit: float) -> bool:
    return share is None or share <= limit


def rounds_finished(shares: Sequence[float | None], wanted: int, max_reruns: int, limit: float) -> bool:
    """Whether to stop: ``wanted`` clean rounds are done, or ``wanted + max_reruns`` rounds were attempted."""
    clean = sum(1 for share in shares if is_clean(share, limit))
    return clean >= wanted or len(shares) >= wanted + max_reruns


def select_rounds(shares: Sequence[float | None], wanted: int, limit: float) -> list[RoundRecord]:
    """Which attempted rounds the figures come from: the clean ones (other processes at most ``limit`` of the CPU),
    the first ``wanted`` of them. With fewer clean rounds than ``wanted`` the least contaminated dropped rounds fill
    up to ``wanted``, each said so (the result is then NOISY: :func:`rounds_summary`)."""
    clean = [i for i, share in enumerate(shares) if is_clean(share, limit)][:wanted]
    dirty = sorted((share, i) for i, share in enumerate(shares) if share is not None and share > limit)
    fill = [i for _, i in dirty[:max(0, wanted - len(clean))]]
    records = []
    for i, share in enumerate(shares):
        if share is None:
            why = "clean: too short to measure (under one clock tick)"
        elif is_clean(share, limit):
            why = f"clean: other processes used {share:.0%} of the CPU <= {limit:.0%}"
        elif i in fill:
            why = (f"kept to fill: other processes used {share:.0%} of the CPU > {limit:.0%}, only {len(clean)} of "
                   f"{wanted} rounds clean")
        else:
            why = f"dropped: other processes used {share:.0%} of the CPU > {limit:.0%}"
        if is_clean(share, limit) and i not in clean:
            why = "not needed: enough clean rounds before it"
        records.append(RoundRecord(i, share, is_clean(share, limit), i in clean or i in fill, why))
    return records


def rounds_summary(records: Sequence[RoundRecord], wanted: int, max_reruns: int, limit: float) -> dict[str, Any]:
    """The JSON of a series of rounds: what was asked, what was attempted, kept and dropped, and ``noisy`` when
    fewer than ``wanted`` rounds were clean."""
    clean = sum(1 for r in records if r.clean)
    return {"wanted": wanted, "max_reruns": max_reruns, "foreign_cpu_limit": limit, "attempted": len(records),
            "clean": clean, "contaminated": sum(1 for r in records if not r.clean),
            "dropped": sum(1 for r in records if not r.clean and not r.kept), "noisy": clean < wanted,
            "kept_attempts": [r.attempt for r in records if r.kept], "records": [r.as_json() for r in records]}


def run_clean_rounds(wanted: int, max_reruns: int, run_round: Callable[[int], None], pids: Callable[[], Sequence[int]],
                     limit: float = FOREIGN_CPU_LIMIT) -> dict[str, Any]:
    """Run ``run_round(attempt)`` until ``wanted`` rounds were clean (other processes used at most ``limit`` of the
    box's CPU during the round, ``pids`` being the servers counted as the benchmark's own) or ``wanted +
    max_reruns`` were attempted; the :func:`rounds_summary` (its ``kept_attempts`` say whose figures to use)."""
    shares: list[float | None] = []
    while not rounds_finished(shares, wanted, max_reruns, limit):
        before = cpu_snapshot(pids())
        run_round(len(shares))
        shares.append(foreign_share(before, cpu_snapshot(pids())))
    return rounds_summary(select_rounds(shares, wanted, limit), wanted, max_reruns, limit)
