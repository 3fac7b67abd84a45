"""The appliance under test in its own process (``python -m appliance run`` with a config of the benchmark's own):
started, waited for, warmed up, stopped. Its own process, so that its peak memory is its own."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

import appliance
from appliance.benchmark.session import Served, warm_up

SOURCE_ROOT = Path(appliance.__file__).resolve().parents[1]
"""The folder that holds the ``appliance`` package (the repository root in a checkout)."""
START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM a server process that still runs, then SIGKILL it if it has not exited after 15 s."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class Process:
    """A server subprocess with its output in a log file; stopped with SIGTERM (then SIGKILL)."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        path = os.pathsep.join(filter(None, [str(SOURCE_ROOT), os.environ.get("PYTHONPATH")]))
        env = dict(os.environ, PYTHONPATH=path)
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(argv, cwd=SOURCE_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)

    def tail(self, n: int = 2000) -> str:
        with contextlib.suppress(OSError):
            return self.log.read_text(errors="replace")[-n:]
        return ""

    def wait_until(self, ready: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(Exception):
                if ready():
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{what} did not become ready in {START_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        stop_process(self.proc)


def state_folder() -> Path:
    """A fresh state folder with a short path (AF_UNIX socket paths are limited to 108 bytes)."""
    return Path(tempfile.mkdtemp(prefix="ap-bench-"))


@contextlib.contextmanager
def appliance_process(state: Path, config_text: str, port: int, model: str, what: str) -> Iterator[Served]:
    """``appliance run`` on ``config_text`` (written to ``state/appliance.yaml``; it must put its socket at
    ``state/a.sock`` and its HTTP app on ``port``), answering and warmed up; stopped and ``state`` removed after."""
    config = state / "appliance.yaml"
    config.write_text(config_text)
    proc = Process([sys.executable, "-m", "appliance", "--log-level", "warning", "run", "--config", str(config)],
                   state / "appliance.log")
    base_url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        return httpx.get(base_url + "/v1/health", timeout=2).status_code == 200

    try:
        proc.wait_until(ready, what)
        served = Served(base_url, state / "a.sock", proc.proc.pid, proc.log, model)
        warm_up(served)
        yield served
    finally:
        proc.stop()
        shutil.rmtree(state, ignore_errors=True)
