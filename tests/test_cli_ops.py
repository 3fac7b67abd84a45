"""The operator's CLI against a real ``appliance run`` process: ``--host``/``--port`` replace the config's (on a
reload too) and are validated like it, ``appliance ps`` shows the loaded models, ``status`` shows the load profiles
only with ``--verbose``, and a closed pipe (``| head -1``) ends every printing command quietly; the ps lines from
crafted STATUS records (pure)."""

from __future__ import annotations

import json
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from appliance.client import lines as lineclient
from appliance.client import ps
from appliance.daemon import policy

ROOT = Path(__file__).resolve().parents[1]
APPLIANCE = f"{shlex.quote(sys.executable)} -m appliance"


# -- appliance ps, pure --------------------------------------------------------------------------------------------
def model(**changes: object) -> dict[str, object]:
    record: dict[str, object] = {"name": "demo", "state": "loaded", "loaded": True, "refcount": 0, "inflight": 0,
                                 "held_bytes": 48 * ps.MIB, "processor": "CPU", "gpu_layers": "0/5",
                                 "idle_ttl_s": 1800.0, "unloads_in_s": 1740.0}
    record.update(changes)
    return record


def test_ps_lines_say_size_processor_agents_requests_and_when_each_unloads() -> None:
    status = {"device": {"kind": "nvml"}, "models": [
        model(name="demo", refcount=2, unloads_in_s=None),
        model(name="idle", held_bytes=1536 * ps.MIB, unloads_in_s=44.2),
        model(name="busy", inflight=3, unloads_in_s=None, processor="GPU", gpu_layers="5/5"),
        model(name="pinned", idle_ttl_s=0.0, unloads_in_s=None),
        model(name="cold", loaded=False, state="available", unloads_in_s=None)]}
    assert ps.render(ps.loaded_models(status)) == (
        "NAME     SIZE         PROCESSOR   AGENTS   REQUESTS   UNLOADS\n"
        "demo     48.0 MiB     CPU         2        0          when its agents leave\n"
        "idle     1536.0 MiB   CPU         0        0          in 45 seconds\n"
        "busy     48.0 MiB     GPU         0        3          after its requests\n"
        "pinned   48.0 MiB     CPU         0        0          never (idle_ttl_s 0)\n")
    assert ps.render([]) == "NAME   SIZE   PROCESSOR   AGENTS   REQUESTS   UNLOADS\n"  # nothing loaded


@pytest.mark.parametrize(("placed", "split", "shown"), [
    ("CPU", "0/5", "CPU"), ("GPU", "5/5", "GPU"), ("CPU/GPU", "3/5", "CPU/GPU (3/5 layers on the GPU)"),
    (None, None, "unknown")])  # no placement in the record
def test_ps_processor_is_the_daemons_placement(placed: str | None, split: str | None, shown: str) -> None:
    assert ps.processor(model(processor=placed, gpu_layers=split)) == shown


@pytest.mark.parametrize(("seconds", "words"), [
    (0.4, "now"), (1, "in 1 second"), (44.2, "in 45 seconds"), (89.5, "in 90 seconds"), (90, "in 2 minutes"),
    (1740, "in 29 minutes"), (5399, "in 90 minutes"), (5400, "in 2 hours"), (86400, "in 24 hours")])
def test_ps_countdown_in_words(seconds: float, words: str) -> None:
    assert ps.in_words(seconds) == words


def view(**changes: object) -> policy.ModelView:
    fields: dict[str, object] = {"key": "m", "loaded": True, "refcount": 0, "inflight": 0, "last_used": 100.0,
                                 "idle_ttl_s": 300.0}
    fields.update(changes)
    return policy.ModelView(**fields)  # type: ignore[arg-type]


def test_the_idle_ttl_countdown() -> None:
    assert policy.unloads_in(view(), now=160.04) == 240.0
    assert policy.unloads_in(view(), now=1000.0) == 0.0  # past due: the next sweep
    assert policy.unloads_in(view(refcount=1), now=160.0) is None  # its agents hold it
    assert policy.unloads_in(view(inflight=1), now=160.0) is None  # the countdown starts when its requests end
    assert policy.unloads_in(view(idle_ttl_s=0.0), now=160.0) is None  # never
    assert policy.unloads_in(view(loaded=False), now=160.0) is None
    assert policy.unloads_in(view(retired=True), now=160.0) == 0.0  # removed from the config: the next sweep
    sweep_would_unload = policy.expired([view()], now=400.0) == ["m"]
    assert sweep_would_unload and policy.unloads_in(view(), now=400.0) == 0.0  # the two agree


# -- a real appliance process ------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def shell(command: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def appliance(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


@dataclass
class Process:
    config: Path
    port: int
    file_port: int

    @property
    def state(self) -> Path:
        return self.config.parent

    def client(self, *args: str) -> subprocess.CompletedProcess[str]:
        result = appliance(*args, "--config", str(self.config))
        assert result.returncode == 0, result.stderr + result.stdout
        return result


def write_config(path: Path, port: int, **extra: object) -> None:
    state = path.parent
    doc = {"data_dir": str(state), "device": "fake:8GiB", "http": {"host": "127.0.0.1", "port": port},
           "resync_interval_s": 0, "engine": {"warmup_runs": 0},
           "models": [{"name": "demo", "path": str(state / "models" / "demo.gguf"),
                       "generate_if_missing": {"layers": 2, "dim": 128, "seed": 3}},
                      {"name": "other", "path": str(state / "models" / "other.gguf"), "idle_ttl_s": 600,
                       "generate_if_missing": {"layers": 2, "dim": 64, "seed": 4}}], **extra}
    path.write_text(yaml.safe_dump(doc))


@pytest.fixture(scope="module")
def served() -> Iterator[Process]:
    """``appliance run --host 127.0.0.1 --port P`` on a config whose own port is another free one."""
    state = Path(tempfile.mkdtemp(prefix="apo-"))
    port, file_port = free_port(), free_port()
    config = state / "appliance.yaml"
    write_config(config, file_port)
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "run", "--config", str(config),
                             "--host", "127.0.0.1", "--port", str(port)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 90
        while not (state / "registry.json").exists():
            assert proc.poll() is None, "the appliance exited"
            assert time.monotonic() < deadline, "the appliance did not come up"
            time.sleep(0.1)
        yield Process(config, port, file_port)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        subprocess.run(["rm", "-rf", str(state)], check=False)


def registry_http(process: Process) -> str:
    return json.loads((process.state / "registry.json").read_text())["http"]


def test_host_and_port_from_the_command_line_replace_the_files_and_stay_on_reload(served: Process) -> None:
    assert registry_http(served) == f"http://127.0.0.1:{served.port}"
    assert httpx.get(f"http://127.0.0.1:{served.port}/v1/health", timeout=10).json()["status"] == "ok"
    with pytest.raises(httpx.ConnectError):  # the file's own port serves nothing
        httpx.get(f"http://127.0.0.1:{served.file_port}/v1/health", timeout=10)
    text = served.config.read_text()
    try:  # an edit of the file's port (and of something else, so that the reload applies) changes no address
        write_config(served.config, free_port(), admission_percent=80)
        reply = lineclient.request(served.state / "appliance.sock", "RELOAD", 60)
        assert "result=applied" in reply, reply
        assert httpx.get(f"http://127.0.0.1:{served.port}/v1/health", timeout=10).status_code == 200
        assert registry_http(served) == f"http://127.0.0.1:{served.port}"
    finally:
        served.config.write_text(text)
        lineclient.request(served.state / "appliance.sock", "RELOAD", 60)


@pytest.mark.parametrize(("args", "problem"), [
    (["--port", "70000"], "http.port: must be ≤ 65535 (got 70000) (given on the command line)"),
    (["--port", "http"], "http.port: must be an integer (got 'http') (given on the command line)"),
    (["--host", "0.0.0.0"], "http.host: binding to '0.0.0.0' (not loopback) requires http.api_token"),
])
def test_run_refuses_a_bad_host_or_port_like_a_bad_file(tmp_path: Path, args: list[str], problem: str) -> None:
    config = tmp_path / "appliance.yaml"
    write_config(config, 0)
    result = appliance("run", "--config", str(config), *args, timeout=60)
    assert result.returncode == 2, result.stderr
    assert f"refusing to start, 1 problem(s) in {config}:" in result.stderr
    assert f"{config}: {problem}" in result.stderr and "Traceback" not in result.stderr
    checked = appliance("config", "check", str(config), *args)  # config check takes them too
    assert checked.returncode == 1 and problem in checked.stdout


def test_ps_shows_each_loaded_model_and_when_it_unloads(served: Process) -> None:
    served.client("register", "a", "demo")
    served.client("infer", "--model", "other", "Hello", "--max-tokens", "4")
    try:
        lines = served.client("ps").stdout.splitlines()
        assert lines[0].split() == ["NAME", "SIZE", "PROCESSOR", "AGENTS", "REQUESTS", "UNLOADS"]
        rows = {line.split()[0]: line for line in lines[1:]}
        assert sorted(rows) == ["demo", "other"]
        assert rows["demo"].split()[2:6] == ["MiB", "CPU", "1", "0"]  # fake device, n_gpu_layers 0: the CPU
        assert rows["demo"].endswith("when its agents leave")
        assert rows["other"].split()[2:6] == ["MiB", "CPU", "0", "0"] and rows["other"].endswith("in 10 minutes")
        doc = json.loads(served.client("ps", "--json").stdout)
        status = json.loads(served.client("status", "--json").stdout)
        held = {m["name"]: m["held_bytes"] for m in status["models"]}
        assert {row["name"]: row["size_bytes"] for row in doc} == held and all(held.values())
        other = next(row for row in doc if row["name"] == "other")
        assert 590 < other["unloads_in_s"] <= 600 and other["agents"] == 0
    finally:
        served.client("unregister", "a")
    after = served.client("ps").stdout
    assert "demo" not in after  # the last agent left: unloaded at once


def test_status_shows_the_load_profiles_only_when_verbose(served: Process) -> None:
    served.client("infer", "--model", "demo", "Hello", "--max-tokens", "2")  # loaded: it has a profile
    plain = served.client("status").stdout
    verbose = served.client("status", "--verbose").stdout
    assert "ledger:" in plain and "models:" in plain and "profile:" not in plain
    assert "profile:" in verbose and "input_tokens_p50" in verbose
    assert "profile" in json.loads(served.client("status", "--json").stdout)  # the JSON has everything


def test_a_closed_pipe_ends_every_printing_command_quietly(served: Process) -> None:
    config = shlex.quote(str(served.config))
    result = shell(f"{APPLIANCE} status --config {config} | head -1; echo \"exit=${{PIPESTATUS[0]}}\"")
    assert result.stdout.splitlines() == ["device:", "exit=0"] and result.stderr == ""
    # The reader gone before a word is written: every write fails with EPIPE.
    for args in (f"status --config {config}", f"ps --config {config}", f"list --config {config}", "config docs",
                 "config --help"):
        result = shell(f"{{ echo first; sleep 1; {APPLIANCE} {args}; echo \"exit=$?\" >&2; }} | head -1")
        assert result.stdout == "first\n", args
        assert result.stderr == "exit=0\n", (args, result.stderr)  # no traceback, no "Broken pipe" line
