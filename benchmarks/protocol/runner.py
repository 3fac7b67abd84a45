"""One run: start the servers, build every path, check the prompts, measure, summarize, report; and stop it all."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import llama_cpp

from appliance.client import MagnClient
from appliance.engine.runtime import Runtime
from benchmarks.common import ContextThreads, tiny_model
from benchmarks.protocol.clients import Http, MagnAsync, MagnBlocking, MagnRaw
from benchmarks.protocol.inprocess import ComputeThread, DaemonCore, EngineDirect, Library
from benchmarks.protocol.measure import measure, summarize
from benchmarks.protocol.report import report
from benchmarks.protocol.servers import (
    Process,
    appliance_config,
    free_port,
    llama_server_missing,
    probe_appliance_http,
    start_llama_server,
)
from benchmarks.protocol.workload import MODEL_NAME, PROMPTS, Contender


def run(args: argparse.Namespace) -> dict[str, Any]:
    model = tiny_model(args.model_dir, layers=args.layers, dim=args.dim)
    n_batch = min(512, args.n_ctx)
    state = Path(tempfile.mkdtemp(prefix="ap-proto-"))  # short: AF_UNIX paths are limited to 108 bytes
    procs: list[Process] = []
    paths: list[Contender] = []
    compute: ComputeThread | None = None
    http_notes: dict[str, str] = {}
    try:
        http_port = free_port()
        config_text = appliance_config(model, state, n_ctx=args.n_ctx, threads=args.threads, http_port=http_port)
        (state / "appliance.yaml").write_text(config_text)
        appliance = Process([sys.executable, "-m", "appliance", "--log-level", "warning", "run", "--config",
                             str(state / "appliance.yaml")], state / "appliance.log")
        procs.append(appliance)

        compute = ComputeThread(args.threads)
        rt = compute.call(lambda: Runtime(model, n_ctx=args.n_ctx, n_gpu_layers=0, n_threads=args.threads))
        params = ContextThreads(args.threads, args.threads)  # the library gets the engine's threads
        for reset in (True, False):
            llm = compute.call(lambda: llama_cpp.Llama(
                model_path=str(model), n_ctx=args.n_ctx, n_batch=n_batch, n_threads=params.n_threads,
                n_threads_batch=params.n_threads_batch, n_gpu_layers=0, seed=0, verbose=False))
            paths.append(Library(compute, llm, reset=reset))
        paths += [EngineDirect(compute, rt), DaemonCore(compute, config_text, state)]

        http_why = "--no-http was given" if args.no_http else llama_server_missing()
        server: Process | None = None
        if http_why is None:
            port = free_port()
            server = start_llama_server(model, port, params, args.n_ctx, n_batch, state / "llama_server.log")
            procs.append(server)

        def appliance_ready() -> bool:
            with MagnClient(str(state / "a.sock"), timeout=2) as client:
                client.protocol_info()
            return True

        appliance.wait_until(appliance_ready, "the appliance")
        paths += [MagnRaw(state / "a.sock"), MagnAsync(state / "a.sock"), MagnBlocking(state / "a.sock")]
        if args.no_http:
            http_notes["appliance"] = f"skipped: {http_why}"
        else:
            appliance_http_why = probe_appliance_http(f"http://127.0.0.1:{http_port}")
            if appliance_http_why is None:
                paths.append(Http("http_appliance", "HTTP, the appliance's /v1/completions (httpx keep-alive)",
                                  f"http://127.0.0.1:{http_port}", {"model": MODEL_NAME}, usage_in_stream=True))
                http_notes["appliance"] = "measured"
            else:
                http_notes["appliance"] = f"skipped: {appliance_http_why}"
        if server is not None:
            paths.append(Http("http_llama_cpp_server", "HTTP, llama_cpp.server /v1/completions (httpx keep-alive)",
                              f"http://127.0.0.1:{port}"))
            http_notes["llama_cpp_server"] = "measured"
        else:
            http_notes["llama_cpp_server"] = f"skipped: {http_why}"
        for what, note in http_notes.items():
            if note != "measured":
                print(f"note: HTTP path {what}: {note}", flush=True)

        tokenized = [rt.tokenize(p, bos=True) for p in PROMPTS]
        if len({len(t) for t in tokenized}) != 1 or tokenized[0][1] == tokenized[1][1]:
            raise RuntimeError(f"the prompts must have equal token counts and differ after BOS: {tokenized}")

        start = time.perf_counter()
        raw = measure(paths, args)
        wall_s = time.perf_counter() - start
        results = summarize(paths, raw, args)
    finally:
        for p in paths:
            with contextlib.suppress(Exception):
                p.close()
        if compute is not None:
            compute.close()
        for proc in procs:
            proc.stop()
        shutil.rmtree(state, ignore_errors=True)
    return report(args, model, results, http_notes, len(tokenized[0]), wall_s)


