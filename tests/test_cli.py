"""The `appliance` command end to end: real processes, the shipped config's shape, a real daemon."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from appliance import __version__

ROOT = Path(__file__).resolve().parents[1]


def appliance(*args: str, timeout: float = 120, check: bool = False) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True, text=True,
                            timeout=timeout, cwd=ROOT)
    if check:
        assert result.returncode == 0, result.stderr + result.stdout
    return result


def test_config_check_reports_three_mistakes_with_their_lines(tmp_path: Path) -> None:
    bad = tmp_path / "appliance.yaml"
    bad.write_text(
        "data_dir: ./data\n"
        "admission_percnt: 90\n"           # line 2: unknown key
        "max_connections: lots\n"          # line 3: wrong type
        "http:\n"
        "  port: 99999\n"                  # line 5: out of range
        "models: []\n")
    result = appliance("config", "check", str(bad))
    assert result.returncode == 1
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 3, result.stdout
    assert ":2: admission_percnt" in lines[0] and "admission_percent" in lines[0]  # with a suggestion
    assert ":3: max_connections" in lines[1]
    assert ":5: http.port" in lines[2]


def test_run_refuses_an_invalid_file_with_the_report(tmp_path: Path) -> None:
    bad = tmp_path / "appliance.yaml"
    bad.write_text("device: gpu-please\nmodels:\n  - name: m\n    path: ./missing.gguf\n    n_ctx: 1\n")
    result = appliance("run", "--config", str(bad), timeout=60)
    assert result.returncode == 2
    assert "refusing to start, 2 problem(s)" in result.stderr  # a missing model file is not one of them
    assert ":1: device" in result.stderr and ":5: models[0].n_ctx" in result.stderr


def test_shipped_config_is_valid() -> None:
    # Valid on a fresh clone too: the demo models' files may be missing because run generates them.
    result = appliance("config", "check", str(ROOT / "appliance.yaml"))
    assert result.returncode == 0, result.stdout
    assert "ok (2 model(s)" in result.stdout


@pytest.fixture
def daemon_config() -> Iterator[Path]:
    state = Path(tempfile.mkdtemp(prefix="apc-"))
    config = {
        "data_dir": str(state),
        "device": "fake:8GiB",
        "http": {"port": 0},
        "models": [{"name": "demo", "path": str(state / "models" / "demo.gguf"),
                    "generate_if_missing": {"layers": 2, "dim": 128, "seed": 3}}],
    }
    path = state / "appliance.yaml"
    path.write_text(yaml.safe_dump(config))
    yield path
    subprocess.run(["rm", "-rf", str(state)], check=False)


def test_run_serves_the_socket_and_http_until_sigterm(daemon_config: Path) -> None:
    state = daemon_config.parent
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "run", "--config", str(daemon_config)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (state / "registry.json").exists():
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the daemon did not come up"
            time.sleep(0.1)
        registry = json.loads((state / "registry.json").read_text())
        assert registry["models"]["demo"]["state"] == "available"
        assert (state / "models" / "demo.gguf").exists()  # the demo model was made offline
        cfg = ["--config", str(daemon_config)]
        appliance("register", "a", "demo", *cfg, check=True)
        decode = appliance("decode", "a", "8", "Hello", *cfg, check=True).stdout
        assert "OK invoke=DECODE agent_id=a" in decode and "BEGIN_RESPONSE" in decode
        assert json.loads((state / "registry.json").read_text())["models"]["demo"]["state"] == "loaded"
        health = appliance("health", "--model", "demo", *cfg, check=True).stdout
        assert health.startswith("healthy: http http://127.0.0.1:")
        assert "ok" in appliance("protocol-check", "--expect-version", "0x0001", *cfg, check=True).stdout
        assert appliance("protocol-check", "--expect-version", "0x0002", *cfg).returncode == 1
        infer = appliance("infer", "--model", "demo", "Hello", "--max-tokens", "5", *cfg, check=True)
        assert "5 generated tokens" in infer.stderr
        error = appliance("decode", "ghost", "4", "hi", *cfg)
        assert error.returncode == 1 and error.stdout.startswith("ERR UNKNOWN_AGENT")
        check_tables_from_another_folder(daemon_config)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    assert proc.returncode == 0
    assert not (state / "appliance.sock").exists() and not (state / "registry.json").exists()
    down = appliance("health", "--config", str(daemon_config), "--timeout", "2")
    assert down.returncode == 6 and "no appliance answers on" in down.stderr


def test_make_tiny_writes_a_model_llama_cpp_loads(tmp_path: Path) -> None:
    out = tmp_path / "m.gguf"
    result = appliance("models", "make-tiny", str(out), "--layers", "2", "--dim", "128", check=True)
    assert str(out) in result.stdout and out.stat().st_size > 100_000
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(out), n_ctx=256, verbose=False)
    assert llm.tokenize(b"Hello")[0] == llm.token_bos()


def test_config_help_lists_every_setting_from_the_schema() -> None:
    from appliance.config.schema import SETTINGS

    text = appliance("config", "--help", check=True).stdout
    for setting in SETTINGS:
        assert setting.key in text, setting.key


def run_once(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "appliance", "run", "--config", str(config)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_a_busy_port_is_a_startup_failure_not_a_wire_error(daemon_config: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        doc = yaml.safe_load(daemon_config.read_text())
        doc["http"]["port"] = busy.getsockname()[1]
        daemon_config.write_text(yaml.safe_dump(doc))
        result = run_once(daemon_config)
    assert result.returncode == 3
    assert result.stderr.strip().splitlines()[-1].startswith("appliance: cannot start: cannot listen on 127.0.0.1:")
    assert "Traceback" not in result.stderr and "INTERNAL" not in result.stderr


def test_a_socket_path_that_is_a_file_is_refused_and_kept(daemon_config: Path) -> None:
    precious = daemon_config.parent / "appliance.sock"
    precious.write_text("not a socket\n")
    result = run_once(daemon_config)
    assert result.returncode == 4  # a filesystem problem
    assert "is not a socket" in result.stderr and "Traceback" not in result.stderr
    assert precious.read_text() == "not a socket\n"


# -- finding the daemon, tables, JSON, bad arguments, the daemon down -------------------------------------------------
def elsewhere(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The command run from a folder with no appliance.yaml, with only the given APPLIANCE_*/RUNTIME_* variables."""
    clean = {key: value for key, value in os.environ.items()
             if not key.startswith("APPLIANCE_") and key != "RUNTIME_DIRECTORY"}
    clean.update(env or {})
    clean["PYTHONPATH"] = str(ROOT)
    with tempfile.TemporaryDirectory() as folder:
        return subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True, text=True,
                              timeout=timeout, cwd=folder, env=clean)


def check_tables_from_another_folder(config: Path) -> None:
    """status/list as tables and JSON, the daemon found through --config, $APPLIANCE_CONFIG, $APPLIANCE_SOCKET
    and $RUNTIME_DIRECTORY, run from a folder without a config."""
    state = config.parent
    table = elsewhere("status", "--config", str(config))
    assert table.returncode == 0, table.stderr
    assert "ledger:" in table.stdout and "allocated MiB" in table.stdout
    models = table.stdout.split("models:\n", 1)[1].splitlines()
    assert models[0].split()[:2] == ["name", "state"] and models[1].split()[:2] == ["demo", "loaded"]
    agents = table.stdout.split("agents:\n", 1)[1].splitlines()
    assert agents[0].split()[:2] == ["id", "model"] and agents[1].split()[:2] == ["a", "demo"]
    doc = json.loads(elsewhere("status", "--json", env={"APPLIANCE_CONFIG": str(config)}).stdout)
    assert doc["models"][0]["name"] == "demo" and doc["models"][0]["loaded"] is True
    assert doc["agents"][0]["id"] == "a" and isinstance(doc["ledger"]["allocated_bytes"], int)
    assert doc["ledger"]["allocated_bytes"] == doc["models"][0]["estimate_bytes"] > 0
    listed = json.loads(elsewhere("list", "--json", env={"APPLIANCE_SOCKET": str(state / "appliance.sock")}).stdout)
    assert [m["name"] for m in listed["models"]] == ["demo"] and "agents" not in listed
    runtime = elsewhere("list", env={"RUNTIME_DIRECTORY": str(state)})
    assert runtime.returncode == 0 and runtime.stdout.splitlines()[1].split()[:3] == ["name", "state", "path"]


def test_version() -> None:
    result = appliance("--version", check=True)
    assert result.stdout.strip() == f"appliance {__version__}"


@pytest.mark.parametrize("args", [
    ["infer", "--model", "demo", "--temperature", "nan", "hi"],
    ["infer", "--model", "demo", "--temperature", "-1", "hi"],
    ["infer", "--model", "demo", "--max-tokens", "0", "hi"],
    ["infer", "--model", "demo", "--max-tokens", "²", "hi"],
    ["decode", "a", "-1", "hi"],
    ["decode", "a", "0"],
    ["decode", "a", "9" * 5000],
    ["health", "--timeout", "inf"],
    ["--log-level", "loud", "status"],
    ["protocol-check", "--expect-version", "x"],
])
def test_bad_arguments_are_one_usage_line(args: list[str]) -> None:
    result = elsewhere(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith("appliance")
    assert "error: argument" in result.stderr


CLIENT_COMMANDS = [["status"], ["status", "--json"], ["list"], ["resync"], ["register", "a", "demo"],
                   ["unregister", "a"], ["decode", "a", "4", "hi"], ["infer", "--model", "demo", "hi"],
                   ["health"], ["protocol-check"]]


@pytest.mark.parametrize("args", CLIENT_COMMANDS, ids=[" ".join(args) for args in CLIENT_COMMANDS])
def test_every_client_command_with_the_daemon_down_says_where_it_looked(args: list[str], tmp_path: Path) -> None:
    config = tmp_path / "appliance.yaml"
    config.write_text(f"data_dir: {tmp_path}\nmodels: []\n")
    result = elsewhere(*args, "--config", str(config))
    assert result.returncode == 6, result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    (line,) = result.stderr.strip().splitlines()
    assert line == (f"appliance: no appliance answers on {tmp_path / 'appliance.sock'} (from the config {config}): "
                    f"No such file or directory; start one with: appliance run --config {config}")


def test_with_no_config_and_no_socket_the_cli_says_how_to_find_or_start_one() -> None:
    result = elsewhere("status")
    assert result.returncode == 6
    (line,) = result.stderr.strip().splitlines()
    assert "no config (--config, $APPLIANCE_CONFIG, ./appliance.yaml)" in line and "appliance run --config" in line


def test_a_socket_given_on_the_command_line_that_nothing_serves() -> None:
    result = elsewhere("decode", "a", "3", "--socket", "/tmp/nobody-serves-here.sock")
    assert result.returncode == 6
    assert "no appliance answers on /tmp/nobody-serves-here.sock (from --socket)" in result.stderr


def test_a_bad_config_for_a_client_command_is_exit_code_2(tmp_path: Path) -> None:
    config = tmp_path / "appliance.yaml"
    config.write_text("a: &a [*a]\n")
    result = elsewhere("status", "--config", str(config))
    assert result.returncode == 2
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"appliance: cannot use the config {config}: ") and "YAML refused" in line
