"""What every benchmark script shares: where results and generated models go, the cached tiny models, the common
command-line options, and the end of a run (write the JSON, print the table, the path and the HEADLINE)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import llama_cpp

from appliance.engine.tinymodel import write_tiny_model

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_MODEL_DIR = Path(tempfile.gettempdir()) / "appliance-bench-models"


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
