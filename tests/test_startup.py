"""``appliance run`` as an operator meets it: one instance per state folder and socket, a clear line and exit code
for each start-up failure, signals that do not kill, a stop that removes only its own files, the log level."""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import shutil
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
from harness import RawPeer

from appliance.app import Appliance, lock_paths
from appliance.client import lines as lineclient
from appliance.config.validate import parse_config
from appliance.errors import STARTUP_EXIT_CODES
from appliance.protocol import messages as m

ROOT = Path(__file__).resolve().parents[1]
UP_S = 90  # a slow, busy 2-core machine: import, demo model, bind


@pytest.fixture
def state() -> Iterator[Path]:
    """A short state folder (AF_UNIX paths are limited to 108 bytes)."""
    folder = Path(tempfile.mkdtemp(prefix="as-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def write_config(folder: Path, model: Path, **extra: Any) -> Path:
    doc: dict[str, Any] = {"data_dir": str(folder), "device": "fake:8GiB", "http": {"port": 0},
                           "resync_interval_s": 0, "models": [{"name": "demo", "path": str(model)}]}
    doc.update(extra)
    path = folder / "appliance.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def run_once(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "appliance", *args, "run", "--config", str(config)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def start(config: Path) -> subprocess.Popen[str]:
    """A daemon in its own process; returns once its registry file says it is up."""
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "run", "--config", str(config)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    data_dir = Path(yaml.safe_load(config.read_text())["data_dir"])
    deadline = time.monotonic() + UP_S
    while not (data_dir / "registry.json").exists():
        if proc.poll() is not None:
            raise AssertionError(f"the daemon exited {proc.returncode}: {proc.communicate()[0]}")
        assert time.monotonic() < deadline, "the daemon did not come up"
        time.sleep(0.1)
    return proc


def stop(proc: subprocess.Popen[str]) -> str:
    """SIGTERM, wait (bounded); the daemon's whole output."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    output = proc.communicate(timeout=60)[0]
    return output


def answers(socket_path: Path) -> bool:
    return lineclient.request(socket_path, "STATUS", timeout=30).startswith("OK ")


def last_line(result: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in result.stderr, result.stderr
    return result.stderr.strip().splitlines()[-1]


# -- one instance per state folder and per socket --------------------------------------------------------------
def test_a_second_instance_on_the_same_state_folder_is_refused_and_the_first_keeps_its_files(state: Path,
                                                                                             tiny_model: Path):
    config = write_config(state, tiny_model)
    first = start(config)
    try:
        registry_before = (state / "registry.json").read_text()
        result = run_once(config)
        assert result.returncode == STARTUP_EXIT_CODES["busy"] == 3
        assert last_line(result) == (f"appliance: cannot start: another appliance (pid {first.pid}) holds "
                                     f"{state / 'appliance.lock'}")
        assert (state / "appliance.sock").is_socket() and answers(state / "appliance.sock")
        assert (state / "registry.json").read_text() == registry_before
        assert first.poll() is None
    finally:
        output = stop(first)
    assert first.returncode == 0, output


def test_a_second_instance_on_the_same_socket_is_refused_and_the_first_keeps_serving(state: Path,
                                                                                     tiny_model: Path):
    config = write_config(state, tiny_model)
    other = state / "other"
    other.mkdir()
    other_config = write_config(other, tiny_model, socket={"path": str(state / "appliance.sock")})
    first = start(config)
    try:
        result = run_once(other_config)
        assert result.returncode == 3
        assert last_line(result).endswith(f"holds {state / 'appliance.sock.lock'}")
        assert f"pid {first.pid}" in last_line(result)
        assert answers(state / "appliance.sock")
        assert json.loads((state / "registry.json").read_text())["pid"] == first.pid
        assert not (other / "registry.json").exists()
    finally:
        stop(first)
    assert first.returncode == 0


def test_sighup_and_sigusr1_do_not_kill_and_sigterm_removes_only_its_own_files(state: Path, tiny_model: Path):
    config = write_config(state, tiny_model)
    keep = state / "notes.txt"
    keep.write_text("the operator's\n")
    first = start(config)
    try:
        for sig in (signal.SIGHUP, signal.SIGUSR1, signal.SIGHUP):
            first.send_signal(sig)
            time.sleep(0.3)
            assert first.poll() is None, f"{sig.name} killed the daemon"
        assert answers(state / "appliance.sock")
    finally:
        output = stop(first)
    assert first.returncode == 0, output
    assert output.count("received SIGHUP: re-reading") == 2
    assert "reload (SIGHUP) unchanged" in output
    dumps = [line.split("state: ", 1)[1] for line in output.splitlines() if " state: {" in line]
    assert len(dumps) == 1
    state_doc = json.loads(dumps[0])
    assert state_doc["pid"] == first.pid and state_doc["config"]["status"] == "ok"
    assert state_doc["config"]["sha256"] == hashlib.sha256(config.read_bytes()).hexdigest()
    assert {"ledger", "models", "agents", "host_kv"} <= set(state_doc["daemon"])
    assert "appliance stopped (signal SIGTERM)" in output
    assert not (state / "appliance.sock").exists() and not (state / "registry.json").exists()
    assert keep.read_text() == "the operator's\n" and config.exists()
    for lock in (state / "appliance.lock", state / "appliance.sock.lock"):  # kept (never unlinked), pid emptied
        assert lock.exists() and lock.read_text() == ""


def test_a_busy_port_fails_the_start_without_touching_the_running_instance(state: Path, tiny_model: Path):
    """Same HTTP port, other state folder and socket: refused by the port, the first instance intact."""
    first_config = write_config(state, tiny_model)
    first = start(first_config)
    try:
        port = int(json.loads((state / "registry.json").read_text())["http"].rsplit(":", 1)[1])
        other = state / "other"
        other.mkdir()
        result = run_once(write_config(other, tiny_model, http={"port": port}))
        assert result.returncode == 3
        assert last_line(result).startswith(f"appliance: cannot start: cannot listen on 127.0.0.1:{port}")
        assert answers(state / "appliance.sock") and (state / "registry.json").exists()
        assert not (other / "appliance.sock").exists() and not (other / "registry.json").exists()
    finally:
        stop(first)
    assert first.returncode == 0


# -- start-up failure classes: one line, a distinct exit code, nothing deleted -------------------------------------
def _under_a_file(state: Path) -> dict[str, Any]:
    (state / "plain").write_text("a file\n")
    return {"data_dir": str(state / "plain" / "state")}


def _missing_parent(state: Path) -> dict[str, Any]:
    return {"data_dir": str(state / "missing" / "state")}


def _long_socket(state: Path) -> dict[str, Any]:
    return {"socket": {"path": str(state / ("s" * 110 + ".sock"))}}


def _socket_is_a_folder(state: Path) -> dict[str, Any]:
    (state / "sockdir").mkdir()
    return {"socket": {"path": str(state / "sockdir")}}


def _socket_under_a_file(state: Path) -> dict[str, Any]:
    (state / "plain").write_text("a file\n")
    return {"socket": {"path": str(state / "plain" / "a.sock")}}


def _socket_is_a_file(state: Path) -> dict[str, Any]:
    (state / "precious").write_text("keep me\n")
    return {"socket": {"path": str(state / "precious")}}


def _socket_is_a_link_to_a_file(state: Path) -> dict[str, Any]:
    (state / "precious").write_text("keep me\n")
    (state / "link.sock").symlink_to(state / "precious")
    return {"socket": {"path": str(state / "link.sock")}}


def _no_such_gpu(state: Path) -> dict[str, Any]:
    return {"device": "nvml:97"}


FAILURES = [
    (_under_a_file, 4, "cannot create it"),
    (_missing_parent, 4, "does not exist"),
    (_long_socket, 4, "a Unix socket path allows at most 107"),
    (_socket_is_a_folder, 4, "is a folder"),
    (_socket_under_a_file, 4, "cannot create its folder"),
    (_socket_is_a_file, 4, "exists and is not a socket"),
    (_socket_is_a_link_to_a_file, 4, "exists and is not a socket"),
    (_no_such_gpu, 5, "cannot open memory device nvml:97"),
]


@pytest.mark.parametrize(("make", "code", "says"), FAILURES, ids=[make.__name__.strip("_") for make, *_ in FAILURES])
def test_each_startup_failure_is_one_line_with_its_exit_code(state: Path, tiny_model: Path, make, code: int,
                                                             says: str):
    config = write_config(state, tiny_model, **make(state))
    before = {path: path.read_bytes() for path in state.rglob("*") if path.is_file()}
    result = run_once(config)
    assert result.returncode == code, result.stderr
    line = last_line(result)
    assert line.startswith("appliance: cannot start: ") and says in line, line
    for path, content in before.items():
        assert path.read_bytes() == content, f"{path} changed"
    assert not (state / "missing").exists()
    assert not list(state.rglob("registry.json")) and not any(path.is_socket() for path in state.rglob("*"))


def _as_unprivileged() -> list[str]:
    """A command prefix that runs as an ordinary user (root writes through folder permissions)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("running as root without setpriv")
    return [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]


def test_an_unwritable_data_dir_is_a_filesystem_failure(state: Path):
    state.chmod(0o755)
    locked = state / "locked"
    locked.mkdir(mode=0o555)
    locked.chmod(0o555)
    config = write_config(state, state / "unused.gguf", data_dir=str(locked), models=[])
    config.chmod(0o644)
    result = subprocess.run([*_as_unprivileged(), sys.executable, "-m", "appliance", "run", "--config", str(config)],
                            cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 4, result.stderr
    assert last_line(result) == f"appliance: cannot start: data_dir {locked} is not writable by this user"
    assert list(locked.iterdir()) == []


def test_an_invalid_config_is_exit_code_2(state: Path, tiny_model: Path):
    config = write_config(state, tiny_model)
    config.write_text(config.read_text() + "a: &a [*a]\n")
    result = run_once(config)
    assert result.returncode == 2
    assert "YAML refused" in result.stderr and "Traceback" not in result.stderr


def test_run_help_lists_the_exit_codes():
    result = subprocess.run([sys.executable, "-m", "appliance", "run", "--help"], cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0
    for code in ("2 ", "3 ", "4 ", "5 ", "6 "):
        assert f"\n  {code}" in result.stdout, code


# -- in process: locks and the log level -------------------------------------------------------------------------
def test_lock_files_sit_in_the_state_folder_and_beside_the_socket(tmp_path: Path):
    config = parse_config(f"data_dir: {tmp_path}\nsocket: {{path: /run/x/a.sock}}\n", check_files=False)
    assert lock_paths(config) == [tmp_path / "appliance.lock", Path("/run/x/a.sock.lock")]
    same = parse_config(f"data_dir: {tmp_path}\nsocket: {{path: {tmp_path}/appliance}}\n", check_files=False)
    assert lock_paths(same) == [tmp_path / "appliance.lock"]  # one lock when both are the same file


def test_log_level_comes_from_the_config_and_an_explicit_override_wins(tmp_path: Path):
    logger = logging.getLogger("appliance")
    saved = logger.level
    try:
        quiet = parse_config(f"data_dir: {tmp_path}\nlog_level: warning\n", check_files=False)
        app = Appliance(quiet)
        app.apply_log_level()
        assert logger.level == logging.WARNING
        app.config = parse_config(f"data_dir: {tmp_path}\nlog_level: debug\n", check_files=False)  # a reload
        app.apply_log_level()
        assert logger.level == logging.DEBUG
        Appliance(quiet, log_level="error").apply_log_level()
        assert logger.level == logging.ERROR
    finally:
        logger.setLevel(saved)


def test_log_level_of_the_yaml_applies_to_run(state: Path, tiny_model: Path):
    """The start-up failure logs its stop line at INFO: present by default, gone at warning, back with
    an explicit --log-level."""
    config = write_config(state, tiny_model, device="nvml:97")
    assert "appliance stopped (start-up failed" in run_once(config).stderr
    config = write_config(state, tiny_model, device="nvml:97", log_level="warning")
    assert "appliance stopped" not in run_once(config).stderr
    assert "appliance stopped" in run_once(config, "--log-level", "info").stderr


@pytest.mark.parametrize("grace_s", [30, 0])
def test_sigterm_during_a_stream_ends_it_cleanly_and_exits_0(state: Path, tiny_model: Path, grace_s: float):
    """A real SIGTERM while a MAGN stream runs: the client gets its completion (within the grace period) or a
    SHUTTING_DOWN error, never a dropped connection; then the socket file is gone and the exit code is 0."""
    config = write_config(state, tiny_model, shutdown_grace_s=grace_s,
                          models=[{"name": "demo", "path": str(tiny_model), "n_ctx": 4096}])
    proc = start(config)
    try:
        peer = RawPeer(state / "appliance.sock", timeout=60)
        peer.send({"type": "INFER_REQUEST", "task_id": "t", "model": "demo", "prompt": "Hello",
                   "max_tokens": 4000, "temperature": 0, "stream": True})
        assert isinstance(peer.read_token(), m.StreamToken)
        proc.send_signal(signal.SIGTERM)
        end = peer.read_until_end("t")[-1]
        peer.close()
    finally:
        output = stop(proc)
    assert proc.returncode == 0, output
    if isinstance(end, m.ErrorMessage):
        assert end.error.code == "SHUTTING_DOWN", end
    else:
        assert isinstance(end, m.TaskComplete), end
        assert grace_s > 0
    assert not (state / "appliance.sock").exists() and not (state / "registry.json").exists()


def test_the_objects_alive_once_started_are_left_out_of_full_collections_until_the_stop(tiny_model: Path) -> None:
    from harness import running

    with running({"tiny": {"path": str(tiny_model)}}, model_dirs=[tiny_model.parent]) as app:
        assert gc.get_freeze_count() > 0
        assert not any(tracked is app.appliance for tracked in gc.get_objects())  # a collection never walks it
        assert app.line("REGISTER a tiny").startswith("OK")  # and it serves
    assert gc.get_freeze_count() == 0  # stopped: what it held can be collected again
