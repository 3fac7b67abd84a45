"""``kill -9`` and restart (issue: "the rest of this round's cases"): ``appliance run`` as its own process, killed
with SIGKILL in the middle of a stream, then started again on the same config and state folder, twice.

What a killed daemon leaves behind (a socket file nobody listens on, lock files naming a dead pid, a registry
naming it) must not stop the next start, and the state folder must hold no half-written file of ours. The agent
registered after the first restart is still registered after the second (durable agents: tests/hostile/
test_hostile_durable.py asserts their conversations).
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from harness import RawPeer
from hostile_checks import HUNG_S

from appliance.client import lines as lineclient
from appliance.protocol import messages as m

ROOT = Path(__file__).resolve().parents[2]
UP_S = 90.0  # a slow, busy 2-core machine: import, device, bind
KILLS = 2
OURS = {"appliance.yaml", "appliance.lock", "appliance.sock.lock", "appliance.sock", "registry.json", "agents.db",
        "agents.db-wal", "agents.db-shm", "kv"}
"""What the state folder may hold after a start: the config (the test's), the two locks, the socket, the registry,
the agents' store (SQLite in WAL mode) and the folder of KV files (``kv/<agent>.kv``)."""


@pytest.fixture
def folder() -> Iterator[Path]:
    """A short state folder (AF_UNIX paths are limited to 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="hr-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def write_config(folder: Path, model: Path) -> Path:
    doc: dict[str, Any] = {"data_dir": str(folder), "device": "fake:8GiB", "http": {"port": 0},
                           "resync_interval_s": 0, "models": [{"name": "demo", "path": str(model), "n_ctx": 1024}]}
    path = folder / "appliance.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def registry_pid(folder: Path) -> int | None:
    try:
        return json.loads((folder / "registry.json").read_text())["pid"]
    except (OSError, ValueError, KeyError):
        return None


def start(config: Path) -> subprocess.Popen[str]:
    """``appliance run`` in its own process; returns once the registry names it (a killed one's may be there)."""
    proc = subprocess.Popen([sys.executable, "-m", "appliance", "run", "--config", str(config)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + UP_S
    while registry_pid(config.parent) != proc.pid:
        if proc.poll() is not None:
            raise AssertionError(f"the daemon exited {proc.returncode}: {proc.communicate()[0][-3000:]}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the daemon did not come up within {UP_S:g} s: {proc.communicate()[0][-3000:]}")
        time.sleep(0.05)
    return proc


def refused(path: Path) -> bool:
    """Connecting to the socket file is refused at once (nobody listens on it)."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        try:
            sock.connect(str(path))
        except ConnectionRefusedError:
            return True
        return False


def kill_mid_stream(folder: Path, proc: subprocess.Popen[str]) -> int:
    """Stream a long generation, SIGKILL the daemon once tokens flow; the tokens read before the kill. The
    client sees its connection end, not a hang."""
    peer = RawPeer(folder / "appliance.sock", timeout=HUNG_S)
    try:
        peer.send({"type": "INFER_REQUEST", "task_id": "long", "model": "demo", "prompt": "Once upon a time",
                   "max_tokens": 1000, "temperature": 0.8, "stream": True})
        tokens = 0
        while tokens < 5:
            if isinstance(peer.read_token(), m.StreamToken):
                tokens += 1
        proc.send_signal(signal.SIGKILL)
        proc.wait(HUNG_S)
        try:
            while True:
                peer.read()
        except TimeoutError:
            raise AssertionError("the client's stream hung after the kill") from None
        except ConnectionError:
            pass  # closed or reset: the client knows its daemon is gone
    finally:
        peer.close()
    proc.communicate(timeout=HUNG_S)
    return tokens


def serves(folder: Path, first: bool) -> None:
    """The restarted daemon answers STATUS and decodes on the socket, and answers health over HTTP; the agent
    ``after``, registered after the first restart, is still registered after the next."""
    path = folder / "appliance.sock"
    assert lineclient.request(path, "STATUS", timeout=HUNG_S).startswith("OK ")
    reply = lineclient.request(path, "REGISTER after demo", timeout=HUNG_S)
    if first:
        assert reply.startswith("OK"), reply
    else:
        assert reply.startswith("ERR AGENT_EXISTS"), reply
    decoded = lineclient.request(path, "DECODE after 4 Hello", timeout=HUNG_S)
    assert lineclient.header_fields(decoded)["generated_tokens"] == "4", decoded
    url = json.loads((folder / "registry.json").read_text())["http"]
    assert httpx.get(url + "/v1/health", timeout=HUNG_S).json()["status"] == "ok"


def strays(folder: Path) -> list[str]:
    """Files in the state folder that are not :data:`OURS` (a temporary of a write the kill cut short)."""
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*")
                  if path.name not in OURS and not (path.parent.name == "kv" and path.suffix == ".kv"
                                                    and not path.name.startswith(".")))


def test_kill_9_mid_stream_then_restart_on_the_same_state_folder(record_case, folder: Path, tiny_model: Path):
    """Twice: a stream runs, SIGKILL; the socket file, both lock files and the registry of the dead process stay
    (a client is refused at once, no hang); the next start on the same config takes the locks, replaces the socket,
    rewrites the registry with its pid and serves (socket and HTTP), and the folder holds only our whole files: no
    temporary, the registry valid JSON, each lock naming the live pid. A last SIGTERM stops it cleanly."""
    config = write_config(folder, tiny_model)
    crashed = hung = True
    proc = start(config)
    try:
        for kill in range(KILLS):
            dead = proc.pid
            tokens = kill_mid_stream(folder, proc)
            assert tokens >= 5
            assert (folder / "appliance.sock").is_socket() and registry_pid(folder) == dead
            assert refused(folder / "appliance.sock")
            proc = start(config)
            serves(folder, first=kill == 0)
            assert not strays(folder), strays(folder)
            for lock in ("appliance.lock", "appliance.sock.lock"):
                assert (folder / lock).read_text().strip() == str(proc.pid), lock
        hung = False
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=HUNG_S)[0]
        crashed = proc.returncode != 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=HUNG_S)
        record_case(crashed=crashed, hung=hung, lost_data=not (config.exists() and tiny_model.exists()))
    assert proc.returncode == 0, output[-3000:]
    assert not (folder / "appliance.sock").exists() and not (folder / "registry.json").exists()
    assert not strays(folder), strays(folder)
