"""The ``appliance`` command: a thin shell over the application object, the config and the clients.

Every failure is one line on stderr and an exit code from :data:`EXIT_CODES`, never a traceback."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import re
import select
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from appliance import __version__
from appliance.daemon import registry
from appliance.errors import STARTUP_EXIT_CODES, ApplianceError, StartupError
from appliance.protocol.lines import parse_fields

if TYPE_CHECKING:
    from appliance.benchmark.apply import ConfigNotWritable
    from appliance.benchmark.inplace import RunningAppliance

log = logging.getLogger(__name__)

DEFAULT_CONFIG = "appliance.yaml"
SOCKET_NAME = "appliance.sock"
EXIT_FAILED = 1
EXIT_CONFIG_INVALID = 2
EXIT_NOT_RUNNING = 6
EXIT_INTERRUPTED = 130
EXIT_CODES: dict[int, str] = {
    0: "success",
    EXIT_FAILED: "the command failed: an ERR reply, unhealthy, a protocol mismatch, an invalid config (config check)",
    EXIT_CONFIG_INVALID: "bad arguments, or the config file is invalid",
    STARTUP_EXIT_CODES["busy"]: "cannot start: another appliance holds the state folder or socket, or the port is busy",
    STARTUP_EXIT_CODES["filesystem"]: "cannot start: a path cannot be used (data_dir, socket path, lock, model file)",
    STARTUP_EXIT_CODES["device"]: "cannot start: the memory device cannot be opened",
    EXIT_NOT_RUNNING: "no appliance answers where the command looked",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
MIB = 1024 * 1024


def exit_code_table() -> str:
    return "exit codes:\n" + "\n".join(f"  {code:<4} {meaning}" for code, meaning in EXIT_CODES.items())


class CliError(Exception):
    """A failure of the command: printed as ``appliance: <message>``, exit ``code``."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.message = message
        self.code = code


# -- argument types (argparse turns their ArgumentTypeError into a one-line usage error, exit 2) ------------
def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number (got {text!r})")
    return value


def temperature(text: str) -> float:
    value = _number(text)
    if not 0.0 <= value <= 2.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 2 (got {text})")
    return value


def seconds(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds (got {text})")
    return value


def count(text: str) -> int:
    """A positive integer written in ASCII digits."""
    if not re.fullmatch(r"[0-9]{1,9}", text.strip()):
        raise argparse.ArgumentTypeError(f"must be a whole number from 1 to 999999999 (got {text!r})")
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 (got {text})")
    return value


def log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"must be one of {', '.join(LOG_LEVELS)} (got {text!r})")
    return text.lower()


# -- finding the daemon -----------------------------------------------------------------------------------
@dataclass
class Target:
    """Where a client command talks to: the socket, the HTTP base URL (None: unknown), and how it was found."""

    socket: Path
    http: str | None
    found_by: str
    config: Path | None = None


def config_path(args: argparse.Namespace) -> Path:
    return Path(getattr(args, "config", None) or os.environ.get("APPLIANCE_CONFIG") or DEFAULT_CONFIG)


def _client_config(args: argparse.Namespace) -> Path | None:
    """--config, else $APPLIANCE_CONFIG, else ./appliance.yaml when it exists; None when there is none."""
    given = getattr(args, "config", None) or os.environ.get("APPLIANCE_CONFIG")
    if given:
        return Path(given)
    if Path(DEFAULT_CONFIG).is_file():
        return Path(DEFAULT_CONFIG)
    return None


def _load_client_config(path: Path):  # type: ignore[no-untyped-def]
    from appliance.config.validate import ConfigInvalid, load_config

    try:
        return load_config(path, check_files=False)
    except ConfigInvalid as exc:
        first = exc.problems[0] if exc.problems else "invalid"
        raise CliError(f"cannot use the config {path}: {first}", EXIT_CONFIG_INVALID) from None


def find_daemon(args: argparse.Namespace) -> Target:
    """The daemon's socket: --socket, else $APPLIANCE_SOCKET, else the config's registry file (its state
    folder) or its socket.path, else $RUNTIME_DIRECTORY/appliance.sock. HTTP comes from the registry or config."""
    http: str | None = None
    config_file = _client_config(args)
    doc: dict[str, Any] = {}
    config = None
    explicit = getattr(args, "socket", None) or os.environ.get("APPLIANCE_SOCKET")
    if config_file is not None:
        try:
            config = _load_client_config(config_file)
        except CliError:
            if not explicit:  # the socket was given: the config only adds the HTTP endpoint
                raise
    if config is not None:
        doc = registry.read(config.data_dir) or {}
        http = str(doc.get("http") or f"http://{config.http.host}:{config.http.port}")
    if getattr(args, "socket", None):
        return Target(Path(args.socket), http, "--socket", config_file)
    if os.environ.get("APPLIANCE_SOCKET"):
        return Target(Path(os.environ["APPLIANCE_SOCKET"]), http, "$APPLIANCE_SOCKET", config_file)
    if config is not None and config_file is not None:
        found = doc.get("socket")
        if found:
            return Target(Path(found), http, f"the registry {registry.path(config.data_dir)}", config_file)
        return Target(config.socket.path, http, f"the config {config_file}", config_file)
    no_config = f"no config (--config, $APPLIANCE_CONFIG, ./{DEFAULT_CONFIG})"
    runtime = os.environ.get("RUNTIME_DIRECTORY")
    if runtime:
        return Target(Path(runtime.split(":")[0]) / SOCKET_NAME, None, f"$RUNTIME_DIRECTORY; {no_config}")
    raise CliError(f"cannot find the appliance: {no_config}, no $RUNTIME_DIRECTORY; give --socket PATH or "
                   f"--config FILE, or start one with: appliance run --config {DEFAULT_CONFIG}", EXIT_NOT_RUNNING)


def _not_running(target: Target, reason: str) -> CliError:
    config = target.config or Path(DEFAULT_CONFIG)
    return CliError(f"no appliance answers on {target.socket} (from {target.found_by}): {reason}; "
                    f"start one with: appliance run --config {config}", EXIT_NOT_RUNNING)


def reachable_socket(args: argparse.Namespace) -> Target:
    """The target, after checking that something accepts connections on its socket (else exit 6)."""
    target = find_daemon(args)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(5)
        try:
            probe.connect(str(target.socket))
        except OSError as exc:
            raise _not_running(target, exc.strerror or str(exc)) from None
    return target


def socket_path(args: argparse.Namespace) -> Path:
    return reachable_socket(args).socket


def request_line(args: argparse.Namespace, line: str, timeout: float = 300.0) -> str:
    """Send one line-protocol command to the daemon and return its reply."""
    from appliance.client import lines as lineclient  # lazy: `appliance run` needs no client (about 1 MiB)

    target = reachable_socket(args)
    try:
        return lineclient.request(target.socket, line, timeout)
    except (OSError, TimeoutError) as exc:
        raise _not_running(target, str(exc)) from None


# -- commands ------------------------------------------------------------------------------------
def cmd_run(args: argparse.Namespace) -> int:
    from appliance.app import Appliance
    from appliance.config.validate import ConfigInvalid

    try:
        appliance = Appliance.from_file(config_path(args), data_dir=args.data_dir, socket_path=args.socket,
                                        settings=command_line_settings(args), log_level=args.log_level)
    except ConfigInvalid as exc:
        print(f"appliance: refusing to start, {len(exc.problems)} problem(s) in {config_path(args)}:",
              file=sys.stderr)
        for problem in exc.problems:
            print(f"  {problem}", file=sys.stderr)
        return EXIT_CONFIG_INVALID
    except StartupError as exc:
        print(f"appliance: cannot start: {exc.message}", file=sys.stderr)
        return exc.exit_code
    try:
        asyncio.run(appliance.run())
    except StartupError as exc:
        print(f"appliance: cannot start: {exc.message}", file=sys.stderr)
        return exc.exit_code
    return 0


def command_line_settings(args: argparse.Namespace) -> dict[str, str]:
    """The settings ``--host``/``--port`` give, by key, as written (the config's validation checks them)."""
    given = {"http.host": args.host, "http.port": args.port}
    return {key: value for key, value in given.items() if value is not None}


def cmd_config_check(args: argparse.Namespace) -> int:
    from appliance.config.validate import ConfigInvalid, load_config

    path = Path(args.file) if args.file else config_path(args)
    try:
        config = load_config(path, data_dir=args.data_dir,
                             socket_path=args.socket, settings=command_line_settings(args))
    except ConfigInvalid as exc:
        for problem in exc.problems:
            print(problem)
        print(f"{path}: {len(exc.problems)} problem(s)", file=sys.stderr)
        return 1
    from appliance.config.modelfiles import missing_models

    missing = missing_models(config, Path.is_file, skip_generated=True)  # valid: served as missing until there
    for found in missing:
        place = found.file if found.line is None else f"{found.file}:{found.line}"
        print(f"warning: {place}: {found.key}: no such file {found.path} (model {found.name} is served as missing "
              f"until the file is there; the other models serve)")
    print(f"{path}: ok ({len(config.models)} model(s), device {config.device}, "
          f"admission {config.admission_percent:g}%)" + (f"; {len(missing)} warning(s)" if missing else ""))
    return EXIT_FAILED if missing and args.strict else 0


def cmd_config_docs(args: argparse.Namespace) -> int:
    from appliance.config.schema import render_docs

    print(render_docs())
    return 0


def cmd_make_tiny(args: argparse.Namespace) -> int:
    from appliance.engine.tinymodel import read_template_file, write_tiny_model

    def progress(done: int, total: int) -> None:
        width = 30
        filled = width * done // max(total, 1)
        print(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{total} tensors", end="", file=sys.stderr)

    template = None if args.chat_template is None else read_template_file(args.chat_template)
    path = write_tiny_model(Path(args.out), layers=args.layers, dim=args.dim, seed=args.seed, dtype=args.dtype,
                            progress=progress, vocab_from=args.vocab, chat_template=template,
                            special_tokens=args.special_token)
    print(file=sys.stderr)
    print(f"{path} ({path.stat().st_size / 1e6:.1f} MB)")
    return 0


MODELS_EPILOG = """\
The file is checked first (the bounded GGUF header reader, then a trial load in a child process) and placed in the
first model_dirs folder (kept where it is when it already lies inside one); the entry goes at the end of models:
with every comment and blank line of the file kept. Refused, with nothing changed: a file that is not a GGUF, a name
(or alias) already used, a file this user cannot read, a config this user may not write (the sudo command to run
is given). Under systemd give --config /etc/appliance/appliance.yaml --data-dir /var/lib/appliance.
HF_ENDPOINT names another hub (a mirror), HF_TOKEN logs in (private or gated repositories)."""


def models_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--name", help="the model's name (default: from the file name)")
    parser.add_argument("--n-ctx", type=count, metavar="N", help="its context size in tokens (default: the "
                        "models[].n_ctx default)")
    parser.add_argument("--config", help=f"config file to add it to (default $APPLIANCE_CONFIG, else "
                                         f"./{DEFAULT_CONFIG})")
    parser.add_argument("--data-dir", type=Path, metavar="DIR", help="state folder, replacing the config's "
                        "data_dir for its {data_dir}/... paths (systemd: /var/lib/appliance)")


def print_added(added: Any) -> None:
    """What ``models add``/``pull`` did: the config's diff on stderr, one line on stdout."""
    sys.stderr.write(added.diff)
    print(f"added model {added.name}: {added.path} ({added.placed}) to {added.config}; a running appliance on it "
          f"picks it up with its hot reload")
    for note in added.notes:
        print(f"note: {note}", file=sys.stderr)


def cmd_models_add(args: argparse.Namespace) -> int:
    from appliance.models.add import COPY, LINK, add_model

    print_added(add_model(config_path(args), args.file, name=args.name, n_ctx=args.n_ctx,
                          placement=COPY if args.copy else LINK, data_dir=args.data_dir))
    return 0


def cmd_models_pull(args: argparse.Namespace) -> int:
    from appliance.models.pull import pull_model

    logging.getLogger("httpx2").setLevel(logging.WARNING)  # not a line per request to the hub
    logging.getLogger("huggingface_hub").propagate = False  # it prints its own warnings (a resumed download) once
    pulled = pull_model(config_path(args), args.repo, args.repo_file, revision=args.revision, name=args.name,
                        n_ctx=args.n_ctx, data_dir=args.data_dir)
    print(f"pulled {pulled.file} from {pulled.repo}: {pulled.checksum.kind} {pulled.checksum.value} verified")
    print_added(pulled.added)
    return 0


def cmd_benchmark(args: argparse.Namespace) -> int:
    """Measure (or read a saved result), save, print, and with --apply write the advice and reload."""
    from appliance.benchmark import apply, progress, report, runner

    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request of the session
    signal.signal(signal.SIGTERM, interrupted)  # stopped (the admin page's run): its appliances stop, folders go
    path = config_path(args)
    if args.result is not None:
        out = args.result
        try:
            result = json.loads(Path(args.result).read_text())
        except (OSError, ValueError) as exc:
            raise CliError(f"cannot read the result {args.result}: {exc}", EXIT_CONFIG_INVALID) from None
        if not isinstance(result, dict) or result.get("benchmark") != runner.NAME:
            raise CliError(f"{args.result} is not a result of appliance benchmark", EXIT_CONFIG_INVALID)
        try:
            apply.recommendations_of(result.get("advice"))
        except ValueError as exc:
            raise CliError(f"{args.result} is not a result of appliance benchmark: {exc}",
                           EXIT_CONFIG_INVALID) from None
    else:
        shown = {"bar": progress.BarProgress, "lines": progress.LineProgress, "none": progress.NoProgress}
        mode = args.progress or ("bar" if sys.stderr.isatty() else "lines")
        bar = shown[mode]()
        running = None if args.socket is None else running_appliance(args)
        options = runner.Options(path, model=args.model, agents=args.agents, rounds=args.rounds, quick=args.quick,
                                 seed=args.seed, running=running, repeats=args.repeats)
        try:
            result = runner.run(options, bar)
            out = args.out or runner.results_folder(path) / runner.result_name(result["finished_at"])
        except runner.BenchmarkError as exc:
            raise CliError(str(exc), EXIT_FAILED) from None
        finally:
            bar.close()
        runner.save(result, Path(out))
        print(f"saved {out}", file=sys.stderr)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(report.text(result))
    if args.apply:
        apply_advice(args, path, result, Path(out))
    return 0 if result["complete"] else EXIT_FAILED


def running_appliance(args: argparse.Namespace) -> RunningAppliance:
    """``benchmark --socket``: the running appliance to measure in place (its socket, HTTP address, process)."""
    from appliance.benchmark.inplace import RunningAppliance

    target = reachable_socket(args)
    if target.http is None:
        raise CliError(f"the appliance on {target.socket} has no known HTTP address: give --config with its "
                       f"config file", EXIT_CONFIG_INVALID)
    pid = None
    if target.config is not None:
        doc = registry.read(_load_client_config(target.config).data_dir) or {}
        if doc.get("socket") == str(target.socket) and isinstance(doc.get("pid"), int):
            pid = doc["pid"]
    return RunningAppliance(target.socket, target.http, pid)


def interrupted(signum: int, frame: object) -> None:
    """SIGTERM as Ctrl-C: the ``finally`` blocks run (exit 130)."""
    raise KeyboardInterrupt


def apply_advice(args: argparse.Namespace, path: Path, result: dict[str, Any], result_file: Path) -> None:
    """Write the result's advice into the config (a diff shown first, confirmed unless --yes), then ask a running
    appliance on that config to reload it (recorded as coming from the benchmark). Only the advised keys, each with
    a value the advice can give, are written (the result file may have been crafted)."""
    from appliance.benchmark import apply

    try:
        changes = apply.pending_changes(path, result.get("advice"))
        if not changes:
            print(f"nothing to apply: {path} already has every advised value", file=sys.stderr)
            return
        planned = apply.plan_changes(path, changes)
    except apply.ConfigNotWritable as exc:
        raise CliError(not_writable(exc, result_file, path), EXIT_FAILED) from None
    except (apply.AdviceRejected, ValueError) as exc:
        raise CliError(f"cannot apply the advice: {exc}", EXIT_FAILED) from None
    print(planned.diff, file=sys.stderr)
    from appliance.benchmark import quality

    found = quality.result_caveats(result)
    if found:
        print(f"this advice rests on a run with caveats ({quality.labels(found)}):", file=sys.stderr)
        for caveat in found:
            print(f"  {caveat.text}", file=sys.stderr)
    if not args.yes:
        if not sys.stdin.isatty():
            raise CliError("--apply asks before writing: give --yes when stdin is not a terminal", EXIT_FAILED)
        answer = input(f"write these changes to {path}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("not applied", file=sys.stderr)
            return
    try:
        apply.apply_changes(path, changes)
    except apply.ConfigNotWritable as exc:
        raise CliError(not_writable(exc, result_file, path), EXIT_FAILED) from None
    except apply.AdviceRejected as exc:  # the file changed since the diff was shown
        raise CliError(f"cannot apply the advice: {exc}", EXIT_FAILED) from None
    print(f"applied {', '.join(sorted(changes))} to {path}", file=sys.stderr)
    try:
        target = reachable_socket(args)
    except CliError:
        print("no appliance answers on this config's socket: the advice applies at its next start", file=sys.stderr)
        return
    from appliance.client import lines as lineclient  # lazy: see request_line
    from appliance.protocol.lines import parse_reply

    reply = parse_reply(lineclient.request(target.socket, "RELOAD benchmark", 120))
    if reply.error is not None:
        raise CliError(f"the running appliance ({target.socket}) did not reload: {reply.error.code}: "
                       f"{reply.error.message}", EXIT_FAILED)
    record = " ".join(f"{key}={reply.fields[key]}" for key in ("result", "trigger", "diff", "applied", "error"))
    print(f"the running appliance ({target.socket}) reloaded: {record}", file=sys.stderr)
    if reply.fields["result"] not in ("applied", "unchanged"):
        raise CliError(f"the reload was {reply.fields['result']}: the file is written, the appliance runs its "
                       f"previous config", EXIT_FAILED)


def not_writable(exc: ConfigNotWritable, result_file: Path, config: Path) -> str:
    """The refusal of a config this process may not write, with the command that applies it as root (unless this
    is root already: then the file system itself is read-only)."""
    from appliance.benchmark import apply

    message = f"cannot apply the advice: {exc.message}"
    if exc.read_only and os.geteuid() != 0:
        message += f"; apply it as root: {apply.root_command(result_file, config)}"
    return message


def cmd_health(args: argparse.Namespace) -> int:
    """One-line verdict on the HTTP health endpoint and the socket; non-zero when either fails."""
    import urllib.request

    from appliance.client import MagnClient

    problems: list[str] = []
    target = reachable_socket(args)  # nothing answers at all: exit 6 with how to start one
    url = None if target.http is None else target.http + "/v1/health"
    if url is not None:
        try:
            with urllib.request.urlopen(url, timeout=args.timeout) as response:
                doc = json.load(response)
            if doc.get("status") != "ok":
                problems.append(f"http status {doc.get('status')!r}")
            if args.model and args.model not in {m["name"] for m in doc.get("models", [])}:
                problems.append(f"model {args.model!r} not served")
        except (OSError, ValueError) as exc:
            problems.append(f"http {url}: {getattr(exc, 'reason', exc)}")
    try:
        with MagnClient(str(target.socket), timeout=args.timeout) as client:
            info = client.protocol_info()
    except (OSError, ApplianceError, TimeoutError) as exc:
        problems.append(f"socket {target.socket}: {exc}")
        info = None
    if problems:
        print("unhealthy: " + "; ".join(problems))
        return EXIT_FAILED
    assert info is not None
    http = "not checked (no config)" if url is None else f"{url} ok"
    print(f"healthy: http {http}, socket {target.socket} speaks MAGN v{info.version} "
          f"({info.server} {info.server_version})")
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


def cmd_protocol_check(args: argparse.Namespace) -> int:
    from appliance.client import MagnClient

    expected = int(args.expect_version, 0)
    with MagnClient(str(socket_path(args)), timeout=args.timeout) as client:
        info = client.protocol_info()
    supported = ", ".join(f"{v:#06x}" for v in info.supported_versions)
    if expected != info.version and expected not in info.supported_versions:
        print(f"protocol mismatch: expected {expected:#06x}, the daemon speaks {info.version:#06x} "
              f"(supports {supported})")
        return EXIT_FAILED
    print(f"protocol ok: {expected:#06x} (daemon speaks {info.version:#06x}, supports {supported}; "
          f"schema {info.schema}, max_frame_bytes {info.max_frame_bytes})")
    return 0


def line_command(build: Callable[[argparse.Namespace], str]) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        reply = request_line(args, build(args))
        sys.stdout.write(reply)
        return EXIT_FAILED if reply.startswith("ERR ") else 0

    return run


# -- STATUS and LIST as tables or JSON ----------------------------------------------------------------
LIST_KINDS = {"model": "models", "agent": "agents"}
"""Record kinds that are lists (a table each); every other kind is one record (a key/value block)."""


def parse_value(text: str) -> Any:
    """A line-protocol field value as JSON would hold it: none, true/false, integers, decimals, else text."""
    if text == "none":
        return None
    if text in ("true", "false"):
        return text == "true"
    if re.fullmatch(r"-?[0-9]+", text):
        return int(text)
    if re.fullmatch(r"-?[0-9]+\.[0-9]+", text):
        return float(text)
    return text


def parse_records(body: str, lists: tuple[str, ...] = ()) -> dict[str, Any]:
    """The body of a STATUS/LIST reply (``<kind> key=value …`` lines) as ``{"models": [...], "ledger": {...}}``,
    in the reply's order; ``lists`` are list kinds that are present (empty) even without a record."""
    doc: dict[str, Any] = {}
    for line in body.split("\n"):  # the body is unescaped: only \n separates its lines
        kind, _, rest = line.partition(" ")
        if not kind:
            continue
        record: dict[str, Any] = {}
        for key, value in parse_fields(rest).items():
            record[key] = parse_value(value)
        if kind in LIST_KINDS:
            doc.setdefault(LIST_KINDS[kind], []).append(record)
        elif kind in doc:  # a second record of a one-record kind: keep them all
            previous = doc[kind]
            doc[kind] = [*previous, record] if isinstance(previous, list) else [previous, record]
        else:
            doc[kind] = record
    for name in lists:
        doc.setdefault(name, [])
    return doc


def show_cell(key: str, value: Any) -> str:
    """A table cell: byte counts in MiB, booleans as yes/no, none as "-"."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if key.endswith("_bytes") and isinstance(value, int | float):
        return f"{value / MIB:.1f}"
    return str(value)


def show_header(key: str) -> str:
    if key.endswith("_bytes"):
        return key.removesuffix("_bytes") + " MiB"
    return key


def render_table(records: list[dict[str, Any]]) -> list[str]:
    """Aligned columns, one per key seen in any record (in first-seen order)."""
    keys: list[str] = []
    for record in records:
        keys += [key for key in record if key not in keys]
    rows = [[show_header(key) for key in keys]]
    rows += [[show_cell(key, record.get(key)) for key in keys] for record in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(keys))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows]


def render_records(doc: dict[str, Any]) -> str:
    out: list[str] = []
    for kind, value in doc.items():
        if isinstance(value, dict):
            pairs = [(show_header(key), show_cell(key, item)) for key, item in value.items()]
            width = max((len(key) for key, _ in pairs), default=0)
            out.append(f"{kind}:")
            out += [f"  {key.ljust(width)}  {item}" for key, item in pairs]
        elif value:
            out.append(f"{kind}:")
            out += ["  " + line for line in render_table(value)]
        else:
            out.append(f"{kind}: none")
        out.append("")
    return "\n".join(out)


def table_command(line: str, lists: tuple[str, ...],
                  verbose_only: tuple[str, ...] = ()) -> Callable[[argparse.Namespace], int]:
    """STATUS or LIST: readable tables, or ``--json`` (the same records as JSON, for scripts); the tables of the
    record kinds ``verbose_only`` only with ``--verbose`` (the JSON always has them)."""

    def run(args: argparse.Namespace) -> int:
        from appliance.client import lines as lineclient  # lazy: see request_line

        reply = request_line(args, line, args.timeout)
        if reply.startswith("ERR "):
            sys.stdout.write(reply)
            return EXIT_FAILED
        doc = parse_records(lineclient.response_body(reply), lists)
        if args.json:
            print(json.dumps(doc, indent=2))
        else:
            if not getattr(args, "verbose", False):
                doc = {kind: value for kind, value in doc.items() if kind not in verbose_only}
            sys.stdout.write(render_records(doc))
        return 0

    return run


def cmd_ps(args: argparse.Namespace) -> int:
    """The loaded models, one line each (:mod:`appliance.client.ps`), from the running appliance's STATUS."""
    from appliance.client import lines as lineclient  # lazy: see request_line
    from appliance.client import ps

    reply = request_line(args, "STATUS", args.timeout)
    if reply.startswith("ERR "):
        sys.stdout.write(reply)
        return EXIT_FAILED
    models = ps.loaded_models(parse_records(lineclient.response_body(reply), ("models", "agents")))
    if args.json:
        print(json.dumps([model.to_dict() for model in models], indent=2))
    else:
        sys.stdout.write(ps.render(models))
    return 0


BENCHMARK_EPILOG = """\
what it runs, each in an appliance process of its own (its own state folder, socket and port; a running
appliance on the same config is not touched), or with --socket on the running appliance in place (the settings
of each measurement held over its file's with the line protocol's TUNE, and let go at the end):
  1. the agent session (agents x rounds, inputs 50-600 tokens, 16- or 128-token answers) with the fixed strategy
     (engine.adaptive false, llama-cpp-python's default threads) and with the adaptive engine;
  2. a hot_pool_slack sweep (the same session, shorter, each request profiled);
  3. greedy decode speed at each thread count;
  4. aggregate decode speed of 1, 2, 4, ... streams decoded together (engine.live_slots rests on it).
It prints the table (TTFT avg / P99, tokens/s, peak memory, memory growth), the device class and the advice, one
reason per line, and saves the result as JSON (the admin page's Benchmarks tab lists it). A quick run, a run of
--repeats 1, or one during which other processes used 10% or more of the CPU is marked with its caveats."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="appliance", description="A local-LLM appliance for edge boxes.",
                                     epilog=exit_code_table(), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"appliance {__version__}")
    parser.add_argument("--log-level", type=log_level, default=os.environ.get("APPLIANCE_LOG_LEVEL"),
                        help="debug|info|warning|error|critical; overrides log_level of the config "
                             "(default: $APPLIANCE_LOG_LEVEL, else the config's)")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, fn: Callable[[argparse.Namespace], int], help: str,
                parent: argparse._SubParsersAction = sub, epilog: str | None = None) -> argparse.ArgumentParser:
        p = parent.add_parser(name, help=help, description=help, epilog=epilog,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        p.set_defaults(fn=fn)
        return p

    def client(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--config", help=f"config file to find the daemon through (default $APPLIANCE_CONFIG, "
                                        f"else ./{DEFAULT_CONFIG} if present)")
        p.add_argument("--socket", help="the daemon's Unix socket (default $APPLIANCE_SOCKET, else the config's "
                                        "registry, else $RUNTIME_DIRECTORY/appliance.sock)")
        return p

    def overrides(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--data-dir", type=Path, metavar="DIR",
                       help="state folder, replacing the config's data_dir; its {data_dir}/... paths (models, "
                            "model_dirs, socket) follow it (systemd: --data-dir ${STATE_DIRECTORY})")
        p.add_argument("--socket", type=Path, metavar="PATH",
                       help="Unix socket path, replacing the config's socket.path "
                            "(systemd: --socket ${RUNTIME_DIRECTORY}/appliance.sock)")
        p.add_argument("--host", metavar="ADDRESS",
                       help="HTTP address to bind, replacing the config's http.host (on every reload too; a "
                            "non-loopback one needs http.api_token)")
        p.add_argument("--port", metavar="PORT",
                       help="HTTP port, replacing the config's http.port (on every reload too; 0 = any free port)")
        return p

    run = command("run", cmd_run, "run the appliance in the foreground", epilog=exit_code_table())
    run.add_argument("--config", help=f"config file (default ./{DEFAULT_CONFIG} or $APPLIANCE_CONFIG)")
    overrides(run)

    from appliance.config.schema import render_help

    config = sub.add_parser("config", help="check or document appliance.yaml", epilog="settings:\n" + render_help(),
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = command("check", cmd_config_check, "validate a config file and print every problem; a model file that "
                    "is not there is a warning (exit 0: the other models serve)", config_sub)
    check.add_argument("file", nargs="?")
    check.add_argument("--strict", action="store_true", help="exit 1 on warnings too (a missing model file)")
    overrides(check)
    command("docs", cmd_config_docs, "print every setting as a markdown table", config_sub)

    models = sub.add_parser("models", help="model files")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    add = command("add", cmd_models_add, "check a GGUF file, put it in the first model_dirs folder and add it to "
                  "the config; a running appliance picks it up with its hot reload", models_sub, epilog=MODELS_EPILOG)
    add.add_argument("file", metavar="FILE.gguf")
    models_options(add)
    placement = add.add_mutually_exclusive_group()
    placement.add_argument("--link", action="store_true", help="a hard link to the file in the folder (the "
                           "default: no second copy; the same file system only)")
    placement.add_argument("--copy", action="store_true", help="a copy of the file in the folder (readable by all)")
    pull = command("pull", cmd_models_pull, "fetch a GGUF file from a Hugging Face repository into the first "
                   "model_dirs folder (resumable, checksum verified), then add it", models_sub, epilog=MODELS_EPILOG)
    pull.add_argument("repo", metavar="REPO", help="owner/name of a model repository")
    pull.add_argument("repo_file", nargs="?", metavar="FILE", help="the .gguf file in it (default: its only one)")
    pull.add_argument("--revision", help="a branch, tag or commit (default: main)")
    models_options(pull)
    tiny = command("make-tiny", cmd_make_tiny, "write a small random-weight llama GGUF", models_sub)
    tiny.add_argument("out")
    tiny.add_argument("--layers", type=count, default=4)
    tiny.add_argument("--dim", type=count, default=256)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--dtype", choices=["f16", "f32"], default="f16")
    tiny.add_argument("--vocab", type=Path, metavar="FILE.gguf",
                      help="take the tokenizer from this GGUF (every tokenizer.* key, e.g. of llama.cpp's vocab-only "
                           "ggml-vocab-*.gguf) and size the embeddings to it (default: a small built-in vocabulary)")
    tiny.add_argument("--chat-template", type=Path, metavar="FILE.jinja",
                      help="write this file as tokenizer.chat_template (default: the --vocab file's, if it has one)")
    tiny.add_argument("--special-token", action="append", default=[], metavar="TEXT",
                      help="append TEXT to the vocabulary as a control token, as fine-tunes add <|im_start|> "
                           "(repeatable)")

    for name, line, lists, verbose_only, text in (
            ("status", "STATUS", ("models", "agents"), ("profile",), "device, ledger, models and agents, as tables"),
            ("list", "LIST", ("models",), (), "configured models and their state, as a table")):
        table = client(command(name, table_command(line, lists, verbose_only), text))
        table.add_argument("--json", action="store_true", help="print the records as JSON (for scripts)")
        table.add_argument("--timeout", type=seconds, default=30.0)
        if verbose_only:
            table.add_argument("--verbose", action="store_true",
                               help="also the adaptive engine's load profiles (--json always has them)")
    ps = client(command("ps", cmd_ps, "the loaded models, one line each: size, CPU/GPU, agents, requests in "
                                      "flight, and when each unloads"))
    ps.add_argument("--json", action="store_true", help="print the lines as JSON (for scripts)")
    ps.add_argument("--timeout", type=seconds, default=30.0)
    client(command("resync", line_command(build_resync), "re-read the device, re-base the ledger"))
    reg = client(command("register", line_command(build_register), "register an agent on a model"))
    reg.add_argument("agent")
    reg.add_argument("model")
    unreg = client(command("unregister", line_command(build_unregister), "unregister an agent"))
    unreg.add_argument("agent")
    decode = client(command("decode", line_command(build_decode), "generate tokens for a registered agent"))
    decode.add_argument("agent")
    decode.add_argument("n_tokens", type=count)
    decode.add_argument("prompt", nargs="?", default="")
    infer = client(command("infer", cmd_infer, "generate over MAGN frames, streaming tokens to the terminal"))
    infer.add_argument("--model", required=True)
    infer.add_argument("prompt")
    infer.add_argument("--max-tokens", type=count, default=64)
    infer.add_argument("--temperature", type=temperature, default=0.0, help="0 (greedy) to 2")
    infer.add_argument("--no-stream", action="store_true", help="print the whole text at the end")
    infer.add_argument("--timeout", type=seconds, default=300.0)
    bench = command("benchmark", cmd_benchmark, "measure this box with an agent session (fixed vs adaptive), then "
                    "advise engine settings; --apply writes them into the config", epilog=BENCHMARK_EPILOG)
    bench.add_argument("--config", help=f"config file whose models and settings are measured (default "
                                        f"./{DEFAULT_CONFIG} or $APPLIANCE_CONFIG)")
    bench.add_argument("--model", help="the model the session runs on (default: the config's first)")
    bench.add_argument("--rounds", type=count, help="rounds of the session (default 20; --quick 3)")
    bench.add_argument("--agents", type=count, help="agents at once (default 4; --quick 2)")
    bench.add_argument("--quick", action="store_true", help="a short run: 2 agents x 3 rounds, 3 slack points, "
                                                            "1 and 2 threads, 1 to 4 streams")
    bench.add_argument("--repeats", type=count, default=1, help="each session and sweep point this many times, "
                       "fixed and adaptive alternating first; the medians are reported (default 1)")
    bench.add_argument("--seed", type=int, default=0, help="the workload's seed")
    bench.add_argument("--json", action="store_true", help="print the result as JSON instead of the table")
    bench.add_argument("--out", type=Path, metavar="FILE", help="save the result here (default "
                       "<data_dir>/benchmarks/appliance-benchmark-<UTC time>.json)")
    bench.add_argument("--progress", choices=("bar", "lines", "none"),
                       help="a bar (default on a terminal), PROGRESS lines on stderr (default otherwise), or none")
    bench.add_argument("--socket", nargs="?", const="", metavar="PATH",
                       help="measure the running appliance in place (its socket; without PATH, found through "
                            "--config) instead of appliance processes of the run's own: each measurement's engine "
                            "settings are held with TUNE on one connection, then let go")
    bench.add_argument("--result", metavar="FILE", help="measure nothing: print (and --apply) a saved result")
    bench.add_argument("--apply", action="store_true", help="write the advice into the config, keeping its "
                                                            "comments; a running appliance reloads it")
    bench.add_argument("--yes", action="store_true", help="with --apply: do not ask before writing")
    health = client(command("health", cmd_health, "check the HTTP health endpoint and the socket"))
    health.add_argument("--model", help="also require this model to be served")
    health.add_argument("--timeout", type=seconds, default=5.0)
    check = client(command("protocol-check", cmd_protocol_check, "check the daemon speaks a MAGN version"))
    check.add_argument("--expect-version", type=protocol_version, default="0x0001", help="e.g. 0x0001")
    check.add_argument("--timeout", type=seconds, default=5.0)
    return parser


def build_resync(args: argparse.Namespace) -> str:
    return "RESYNC"


def build_register(args: argparse.Namespace) -> str:
    return f"REGISTER {args.agent} {args.model}"


def build_unregister(args: argparse.Namespace) -> str:
    return f"UNREGISTER {args.agent}"


def build_decode(args: argparse.Namespace) -> str:
    return f"DECODE {args.agent} {args.n_tokens} {args.prompt}".rstrip()


def protocol_version(text: str) -> str:
    if not re.fullmatch(r"(0x[0-9a-fA-F]{1,4}|[0-9]{1,5})", text):
        raise argparse.ArgumentTypeError(f"must be a version like 0x0001 (got {text!r})")
    return text


def stdout_reader_gone() -> bool:
    """True when stdout is a pipe whose reader has closed it (Linux reports POLLERR on the write end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError):  # no stdout, or not one that can be polled
        return False


def end_quietly() -> int:
    """The reader of our output went away (``appliance status | head -1``): what is left unwritten goes nowhere and
    the command ends as shell tools do, without a word (exit 0)."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # the flush at exit writes there instead of failing again
    os.close(devnull)
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except BrokenPipeError:  # --help into a closed pipe
        if stdout_reader_gone():
            return end_quietly()
        raise
    level = (args.log_level or "info").upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code = args.fn(args)
        sys.stdout.flush()  # now, not at exit: a reader gone meanwhile is found where it can be handled
        return code
    except BrokenPipeError as exc:  # our reader went away, or a socket's peer (that one is an error)
        if stdout_reader_gone():
            return end_quietly()
        print(f"appliance: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    except CliError as exc:
        print(f"appliance: {exc.message}", file=sys.stderr)
        return exc.code
    except StartupError as exc:
        print(f"appliance: cannot start: {exc.message}", file=sys.stderr)
        return exc.exit_code
    except ApplianceError as exc:
        print(f"appliance: {exc.code}: {exc.message}", file=sys.stderr)
        return EXIT_FAILED
    except (OSError, TimeoutError) as exc:
        print(f"appliance: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_NOT_RUNNING
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED
    except Exception as exc:  # the last resort: one line, never a traceback
        log.debug("unexpected failure", exc_info=True)
        print(f"appliance: unexpected {type(exc).__name__}: {exc} (run with --log-level debug for details)",
              file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
