"""The servers under test, each in its own process: the appliance (``python -m appliance run``, with its config)
and llama-cpp-python's ``llama_cpp.server``; whether each can run here, and whether the appliance's HTTP app has a
completions endpoint."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import llama_cpp
import yaml

from appliance.benchmark.servers import Process, free_port, stop_process
from benchmarks.protocol.workload import MODEL_NAME, PROMPTS, http_request

__all__ = ["Process", "free_port", "stop_process"]  # re-exported: the benchmarks start their servers with them

REPO = Path(__file__).resolve().parents[2]


def appliance_config(model: Path, state: Path, *, n_ctx: int, threads: int, http_port: int) -> str:
    return yaml.safe_dump({
        "data_dir": str(state), "device": "host", "model_dirs": [str(model.parent)],
        "socket": {"path": str(state / "a.sock")}, "http": {"host": "127.0.0.1", "port": http_port},
        "resync_interval_s": 0, "log_level": "warning", "engine": {"threads": threads},
        "models": [{"name": MODEL_NAME, "path": str(model), "n_ctx": n_ctx, "idle_ttl_s": 0}],
    }, sort_keys=False)


def llama_server_missing() -> str | None:
    """Why ``llama_cpp.server`` cannot run here, or None when it can."""
    try:
        importlib.import_module("llama_cpp.server.app")
    except ImportError as exc:
        return (f"llama_cpp.server is not importable ({exc}); install its extras: "
                f"pip install 'llama-cpp-python[server]=={llama_cpp.__version__}'")
    return None


def start_llama_server(model: Path, port: int, params: llama_cpp.llama_context_params, n_ctx: int, n_batch: int,
                       log: Path) -> Process:
    import httpx

    proc = Process([sys.executable, "-m", "llama_cpp.server", "--model", str(model), "--host", "127.0.0.1",
                    "--port", str(port), "--n_ctx", str(n_ctx), "--n_batch", str(n_batch),
                    "--n_threads", str(params.n_threads), "--n_threads_batch", str(params.n_threads_batch),
                    "--n_gpu_layers", "0", "--seed", "0", "--verbose", "False"], log)
    try:
        proc.wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200,
                        "llama_cpp.server")
    except BaseException:
        proc.stop()
        raise
    return proc


def probe_appliance_http(base_url: str) -> str | None:
    """None when the appliance answers ``POST /v1/completions``, else why not (what it said instead)."""
    import httpx

    try:
        r = httpx.post(base_url + "/v1/completions", json={**http_request(PROMPTS[0], 1, False), "model": MODEL_NAME},
                       timeout=30)
    except httpx.HTTPError as exc:
        return f"the appliance's HTTP app did not answer POST /v1/completions ({exc})"
    if r.status_code == 200 and "choices" in r.text:
        return None
    return (f"the appliance's HTTP app has no completions endpoint yet (POST /v1/completions -> HTTP {r.status_code} "
            f"{' '.join(r.text.split())[:160]}); so far it serves only /v1/health")

