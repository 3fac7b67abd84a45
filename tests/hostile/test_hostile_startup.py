"""Hostile operators: a second `appliance run` aimed at a running appliance, signal storms, config bombs.

The first three run against the fixture's appliance (the fixture checks it stays alive, keeps serving and loses no
file); the others run `appliance` as a subprocess and record their row with ``record_case``."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from hostile_checks import HUNG_S

from appliance.client import lines as lineclient

ROOT = Path(__file__).resolve().parents[2]
COMMAND_BOUND_S = 20.0  # a refused start or config check: an interpreter start and a refusal, on a busy machine


def appliance(*args: str, cwd: Path = ROOT) -> tuple[subprocess.CompletedProcess[str], float]:
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "appliance", *args], capture_output=True, text=True,
                            timeout=HUNG_S * 2, cwd=cwd)
    return result, time.monotonic() - started


def one_line_failure(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip().splitlines()[-1]


@pytest.fixture
def folder() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(prefix="hs-") as name:
        yield Path(name)


def config_file(folder: Path, **settings: Any) -> Path:
    doc: dict[str, Any] = {"data_dir": str(folder), "device": "fake:8GiB", "http": {"port": 0}, "models": []}
    doc.update(settings)
    path = folder / "appliance.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_second_run_on_the_same_state_folder(hostile, folder: Path):
    """The same state folder (so the same registry): refused, exit 3; the running one keeps every file."""
    served = hostile.neighbour.served
    result, _ = appliance("run", "--config", str(config_file(folder, data_dir=str(hostile.state),
                                                             socket={"path": str(folder / "b.sock")})))
    assert result.returncode == 3
    assert one_line_failure(result).endswith(f"holds {hostile.state / 'appliance.lock'}")
    assert (hostile.state / "registry.json").exists() and hostile.socket.is_socket()
    assert lineclient.request(hostile.socket, "STATUS", timeout=HUNG_S).startswith("OK ")
    assert hostile.neighbour_served_since(served)


def test_second_run_on_the_same_socket(hostile, folder: Path):
    served = hostile.neighbour.served
    result, _ = appliance("run", "--config", str(config_file(folder, socket={"path": str(hostile.socket)})))
    assert result.returncode == 3
    assert one_line_failure(result).endswith(f"holds {hostile.socket}.lock")
    assert hostile.socket.is_socket() and not (folder / "registry.json").exists()
    assert lineclient.request(hostile.socket, "STATUS", timeout=HUNG_S).startswith("OK ")
    assert hostile.neighbour_served_since(served)


def test_second_run_on_the_same_http_port(hostile, folder: Path):
    served = hostile.neighbour.served
    port = int(hostile.http.rsplit(":", 1)[1])
    result, _ = appliance("run", "--config", str(config_file(folder, http={"port": port})))
    assert result.returncode == 3
    assert f"cannot listen on 127.0.0.1:{port}" in one_line_failure(result)
    assert not (folder / "appliance.sock").exists() and not (folder / "registry.json").exists()
    assert hostile.socket.is_socket() and (hostile.state / "registry.json").exists()
    assert hostile.neighbour_served_since(served)


def test_a_signal_storm_does_not_kill_the_daemon(record_case, folder: Path, tiny_model: Path):
    config = config_file(folder, models=[{"name": "demo", "path": str(tiny_model)}])
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "run", "--config", str(config)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    crashed = hung = True
    try:
        deadline = time.monotonic() + 90
        while not (folder / "registry.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the daemon did not come up"
            time.sleep(0.1)
        for i in range(60):
            proc.send_signal(signal.SIGHUP if i % 2 else signal.SIGUSR1)
            time.sleep(0.01)
        time.sleep(0.5)
        crashed = proc.poll() is not None
        assert not crashed, "a SIGHUP/SIGUSR1 killed the daemon"
        assert lineclient.request(folder / "appliance.sock", "STATUS", timeout=HUNG_S).startswith("OK ")
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=HUNG_S)
        hung = False
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=HUNG_S)
        record_case(crashed=crashed, hung=hung)
    assert proc.returncode == 0
    assert not (folder / "appliance.sock").exists() and config.exists() and tiny_model.exists()


def _laughs() -> str:
    text = "a0: &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol, lol]\n"
    for level in range(1, 10):
        text += f"a{level}: &a{level} [{', '.join([f'*a{level - 1}'] * 10)}]\n"
    return text + "model_dirs: *a9\n"


BOMBS = {
    "billion-laughs": _laughs(),
    "deep-nesting": "engine:\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(2000)) + "  " * 2001 + "v\n",
    "deep-flow": "engine: " + "[" * 100_000 + "]" * 100_000 + "\n",
    "50-mb": "# " + "x" * (50 * 1024 * 1024) + "\nmodels: []\n",
}


@pytest.mark.parametrize("command", ["config check", "run"])
@pytest.mark.parametrize("bomb", list(BOMBS))
def test_config_bombs_are_refused_quickly(record_case, folder: Path, bomb: str, command: str):
    """Alias bombs, deep nesting and a 50 MB file: `config check` exit 1 and `run` exit 2, each a clean report
    with the line, in the time an interpreter takes to start (was: past 60 s and 1 GB, RecursionError, 73 s)."""
    config = folder / "appliance.yaml"
    config.write_text(BOMBS[bomb])
    args = ["config", "check", str(config)] if command == "config check" else ["run", "--config", str(config)]
    result, elapsed = appliance(*args)
    record_case(crashed=result.returncode < 0 or "Traceback" in result.stderr, hung=elapsed > COMMAND_BOUND_S)
    assert result.returncode == (1 if command == "config check" else 2), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert elapsed < COMMAND_BOUND_S
    assert "YAML" in result.stdout + result.stderr or "larger than 1024 KiB" in result.stdout + result.stderr
    assert not (folder / "registry.json").exists()
