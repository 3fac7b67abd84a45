"""The ``appliance`` command: a thin shell over the application object, the config and the clients."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path

from appliance.client import lines as lineclient
from appliance.daemon import registry
from appliance.errors import ApplianceError, StartupError

DEFAULT_CONFIG = "appliance.yaml"
EXIT_CONFIG_INVALID = 2
EXIT_STARTUP_FAILED = 3


def config_path(args: argparse.Namespace) -> Path:
    return Path(getattr(args, "config", None) or os.environ.get("APPLIANCE_CONFIG") or DEFAULT_CONFIG)


def find_daemon(args: argparse.Namespace) -> tuple[Path, str]:
    """The daemon's socket and HTTP endpoint: the registry file of the config's state dir, else the config."""
    from appliance.config.validate import load_config

    config = load_config(config_path(args), check_files=False)
    doc = registry.read(config.data_dir) or {}
    http = doc.get("http") or f"http://{config.http.host}:{config.http.port}"
    return Path(getattr(args, "socket", None) or doc.get("socket") or config.socket.path), str(http)


def socket_path(args: argparse.Namespace) -> Path:
    """--socket (no config needed), else as :func:`find_daemon` says."""
    return Path(args.socket) if getattr(args, "socket", None) else find_daemon(args)[0]


# -- commands ------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    from appliance.app import Appliance
    from appliance.config.validate import ConfigInvalid

    try:
        appliance = Appliance.from_file(config_path(args))
    except ConfigInvalid as exc:
        print(f"appliance: refusing to start, {len(exc.problems)} problem(s) in {config_path(args)}:",
              file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return EXIT_CONFIG_INVALID
    try:
        asyncio.run(appliance.run())
    except StartupError as exc:
        print(f"appliance: cannot start: {exc.message}", file=sys.stderr)
        return EXIT_STARTUP_FAILED
    return 0


def cmd_config_check(args: argparse.Namespace) -> int:
    from appliance.config.validate import ConfigInvalid, load_config

    path = Path(args.file) if args.file else config_path(args)
    try:
        config = load_config(path, check_files=lambda p: p.exists())
    except ConfigInvalid as exc:
        for problem in exc.problems:
            print(problem)
        print(f"{path}: {len(exc.problems)} problem(s)", file=sys.stderr)
        return 1
    print(f"{path}: ok ({len(config.models)} model(s), device {config.device}, "
          f"admission {config.admission_percent:g}%)")
    return 0


def cmd_config_docs(args: argparse.Namespace) -> int:
    from appliance.config.schema import render_docs

    print(render_docs())
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from appliance.engine.tinymodel import write_tiny_model

    def progress(done: int, total: int) -> None:
        width = 30
        filled = width * done // max(total, 1)
        print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} tensors", end="", file=sys.stderr)

    path = write_tiny_model(Path(args.out), layers=args.layers, dim=args.dim, seed=args.seed, dtype=args.dtype,
                            progress=progress)
    print(file=sys.stderr)
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


def cmd_infer(args: argparse.Namespace) -> int:
    from appliance.client import MagnClient

    with MagnClient(str(socket_path(args)), timeout=args.timeout) as client:
        request = {"model": args.model, "prompt": args.prompt, "max_tokens": args.max_tokens,
                   "temperature": args.temperature}
        if args.no_stream:
            completion = client.infer(**request)
            sys.stdout.write(completion.text)
        else:
            stream = client.stream(**request)
            for token in stream:
                sys.stdout.write(token.text)
                sys.stdout.flush()
            completion = stream.completion
        sys.stdout.write("\n")
        usage = completion.usage
        print(f"[{usage.prompt_tokens} prompt + {usage.completion_tokens} generated tokens, "
              f"stop={completion.stop_reason}, {completion.timings.get('elapsed_ms', 0):.1f} ms]", file=sys.stderr)
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """One-line verdict on the HTTP health endpoint and the socket; non-zero when either fails."""
    import json
    import urllib.request

    from appliance.client import MagnClient

    problems: list[str] = []
    path, base = find_daemon(args)
    url = base + "/v1/health"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as response:
            doc = json.load(response)
        if doc.get("status") != "ok":
            problems.append(f"http status {doc.get('status')!r}")
        if args.model and args.model not in {m["name"] for m in doc.get("models", [])}:
            problems.append(f"model {args.model!r} not served")
    except OSError as exc:
        problems.append(f"http {url}: {getattr(exc, 'reason', exc)}")
    try:
        with MagnClient(str(path), timeout=args.timeout) as client:
            info = client.protocol_info()
    except (OSError, ApplianceError, TimeoutError) as exc:
        problems.append(f"socket {path}: {exc}")
        info = None
    if problems:
        print("unhealthy: " + "; ".join(problems))
        return 1
    assert info is not None
    print(f"healthy: http {url} ok, socket {path} speaks MAGN v{info.version} ({info.server} {info.server_version})")
    return 0


def cmd_protocol_check(args: argparse.Namespace) -> int:
    from appliance.client import MagnClient

    expected = int(args.expect_version, 0)
    with MagnClient(str(socket_path(args)), timeout=args.timeout) as client:
        info = client.protocol_info()
    supported = ", ".join(f"{v:#06x}" for v in info.supported_versions)
    if expected != info.version and expected not in info.supported_versions:
        print(f"protocol mismatch: expected {expected:#06x}, the daemon speaks {info.version:#06x} "
              f"(supports {supported})")
        return 1
    print(f"protocol ok: {expected:#06x} (daemon speaks {info.version:#06x}, supports {supported}; "
          f"schema {info.schema}, max_frame_bytes {info.max_frame_bytes})")
    return 0


def line_command(build: Callable[[argparse.Namespace], str]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        reply = lineclient.request(socket_path(args), build(args))
        sys.stdout.write(reply)
        return 1 if reply.startswith("ERR ") else 0

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description="A local-LLM appliance for edge boxes.")
    parser.add_argument("--log-level", default=os.environ.get("APPLIANCE_LOG_LEVEL", "info"))
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, fn: Callable[[argparse.Namespace], int], help: str,
                parent: argparse._SubParsersAction = sub) -> argparse.ArgumentParser:
        p = parent.add_parser(name, help=help, description=help)
        p.set_defaults(fn=fn)
        return p

    def client(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--config", help=f"config file to find the daemon through (default {DEFAULT_CONFIG})")
        p.add_argument("--socket", help="the daemon's Unix socket (overrides the registry file)")
        return p

    run = command("run", cmd_run, "run the appliance in the foreground")
    run.add_argument("--config", help=f"config file (default ./{DEFAULT_CONFIG} or $APPLIANCE_CONFIG)")

    from appliance.config.schema import render_help

    config = sub.add_parser("config", help="check or document appliance.yaml", epilog="settings:\n" + render_help(),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = command("check", cmd_config_check, "validate a config file and print every problem", config_sub)
    check.add_argument("file", nargs="?")
    command("docs", cmd_config_docs, "print every setting as a markdown table", config_sub)

    models = sub.add_parser("models", help="model files")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    tiny = command("make-tiny", cmd_make_tiny, "write a small random-weight llama GGUF", models_sub)
    tiny.add_argument("out")
    tiny.add_argument("--layers", type=int, default=4)
    tiny.add_argument("--dim", type=int, default=256)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--dtype", choices=["f16", "f32"], default="f16")

    client(command("status", line_command(lambda a: "STATUS"), "device, ledger, models and agents"))
    client(command("list", line_command(lambda a: "LIST"), "configured models and their state"))
    client(command("resync", line_command(lambda a: "RESYNC"), "re-read the device, re-base the ledger"))
    reg = client(command("register", line_command(lambda a: f"REGISTER {a.agent} {a.model}"),
                         "register an agent on a model"))
    reg.add_argument("agent")
    reg.add_argument("model")
    unreg = client(command("unregister", line_command(lambda a: f"UNREGISTER {a.agent}"), "unregister an agent"))
    unreg.add_argument("agent")
    decode = client(command("decode", line_command(lambda a: f"DECODE {a.agent} {a.n_tokens} {a.prompt}".rstrip()),
                            "generate tokens for a registered agent"))
    decode.add_argument("agent")
    decode.add_argument("n_tokens", type=int)
    decode.add_argument("prompt", nargs="?", default="")
    infer = client(command("infer", cmd_infer, "generate over MAGN frames, streaming tokens to the terminal"))
    infer.add_argument("--model", required=True)
    infer.add_argument("prompt")
    infer.add_argument("--max-tokens", type=int, default=64)
    infer.add_argument("--temperature", type=float, default=0.0)
    infer.add_argument("--no-stream", action="store_true", help="print the whole text at the end")
    infer.add_argument("--timeout", type=float, default=300.0)
    health = client(command("health", cmd_health, "check the HTTP health endpoint and the socket"))
    health.add_argument("--model", help="also require this model to be served")
    health.add_argument("--timeout", type=float, default=5.0)
    check = client(command("protocol-check", cmd_protocol_check, "check the daemon speaks a MAGN version"))
    check.add_argument("--expect-version", default="0x0001", help="e.g. 0x0001")
    check.add_argument("--timeout", type=float, default=5.0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except ApplianceError as exc:
        print(f"appliance: {exc.code}: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
