"""``appliance run`` as its own process on a state folder that outlives it, for the durable-agents cases
(tests/hostile/test_hostile_durable.py): start it, talk to it (line protocol, HTTP), kill it (SIGKILL) or stop it
(SIGTERM) and start it again on the same config.

Each start's output goes to a log file of its own in a folder beside the state folder (never a pipe: a daemon that
logs more than a pipe holds while nobody reads would block), so a case can count the log lines of one run.
"""

from __future__ import annotations

import json
import shutil
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml
from hostile_checks import HUNG_S

from appliance.client import lines as lineclient
from appliance.daemon import store
from appliance.protocol import lines as lineproto

ROOT = Path(__file__).resolve().parents[2]
UP_S = 90.0  # a slow, busy 2-core machine: import, device, bind
STOP_S = 60.0  # a SIGTERM's stop: the drain, the KV write-out, the store's last commit
OURS = {"appliance.yaml", "appliance.lock", "appliance.sock.lock", "appliance.sock", "registry.json", "agents.db",
        "agents.db-wal", "agents.db-shm", "kv"}
"""What the state folder may hold (as tests/hostile/test_hostile_restart.py): the config, the two locks, the socket,
the registry, the agents' store (SQLite in WAL mode) and the folder of KV files (``kv/<agent>.kv``)."""


def write_config(folder: Path, models: dict[str, dict[str, Any]], **extra: Any) -> Path:
    """``<folder>/appliance.yaml``: ``models`` (name: spec) on a fake 8 GiB device, HTTP on a free port; ``extra``
    are more settings (a dict section is merged into the one here)."""
    doc: dict[str, Any] = {"data_dir": str(folder), "device": "fake:8GiB", "http": {"port": 0},
                           "resync_interval_s": 0, "shutdown_grace_s": 20,
                           "models": [{"name": name, **spec} for name, spec in models.items()]}
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(doc.get(key), dict):
            doc[key] = {**doc[key], **value}
        else:
            doc[key] = value
    path = folder / "appliance.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def registry(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / "registry.json").read_text())
    except (OSError, ValueError):
        return None


class Client:
    """Talking to an appliance: its line-protocol socket ``sock`` and its HTTP ``url``."""

    sock: Path
    url: str

    def line(self, text: str, timeout: float = HUNG_S) -> str:
        return lineclient.request(self.sock, text, timeout)

    def agents(self) -> dict[str, dict[str, str]]:
        """STATUS's agents (every page), by id."""
        found: dict[str, dict[str, str]] = {}
        offset = "0"
        while offset != "none":
            reply = self.line(f"STATUS agents {offset}")
            assert reply.startswith("OK "), reply
            for text in lineclient.response_body(reply).splitlines():
                if text.startswith("agent "):
                    record = lineproto.parse_fields(text.removeprefix("agent "))
                    found[record["id"]] = record
            offset = lineclient.header_fields(reply)["agents_next_offset"]
        return found

    def health(self) -> dict[str, Any]:
        return httpx.get(self.url + "/v1/health", timeout=HUNG_S).json()

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """One plain (not streamed) chat completion's JSON; AssertionError unless 200."""
        response = httpx.post(self.url + "/v1/chat/completions", json={**body, "stream": False}, timeout=HUNG_S)
        assert response.status_code == 200, response.text
        return response.json()


@dataclass
class Run(Client):
    """One ``appliance run`` process on ``config`` (its folder is the state folder)."""

    config: Path
    log: Path
    proc: subprocess.Popen[bytes] = field(init=False)
    url: str = field(init=False, default="")

    @property
    def folder(self) -> Path:
        return self.config.parent

    @property
    def sock(self) -> Path:  # type: ignore[override]
        return self.folder / "appliance.sock"

    def start(self) -> Run:
        """Start it; return once the registry names it (a killed one's registry may still be there)."""
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "appliance", "run", "--config", str(self.config)],
                                         cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + UP_S
        while True:
            doc = registry(self.folder)
            if doc is not None and doc.get("pid") == self.proc.pid:
                self.url = doc["http"]
                return self
            if self.proc.poll() is not None:
                raise AssertionError(f"the daemon exited {self.proc.returncode}: {self.output()[-3000:]}")
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"the daemon did not come up within {UP_S:g} s: {self.output()[-3000:]}")
            time.sleep(0.05)

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """SIGKILL, and wait for it to be gone."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(HUNG_S)

    def terminate(self) -> int:
        """SIGTERM; its exit status (killed, and an AssertionError, if it does not exit within :data:`STOP_S`)."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(STOP_S)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"the daemon did not stop within {STOP_S:g} s of SIGTERM: "
                                 f"{self.output()[-3000:]}") from None


def decode_text(reply: str) -> str:
    """A DECODE reply's generated text; AssertionError for anything but a whole OK reply."""
    assert reply.startswith("OK ") and reply.rstrip("\n").endswith("END_RESPONSE"), reply
    return lineclient.response_body(reply)


def strays(folder: Path) -> list[str]:
    """Files in the state folder that are not :data:`OURS` (a temporary of a write that was cut short)."""
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*")
                  if path.name not in OURS and not (path.parent.name == "kv" and path.suffix == ".kv"
                                                    and not path.name.startswith(".")))


def corrupt_files(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.glob("agents.db.corrupt-*"))


@contextmanager
def state_folder() -> Iterator[tuple[Path, Path]]:
    """A short state folder (AF_UNIX paths are limited to 108 bytes) and a folder for the runs' logs."""
    folder = Path(tempfile.mkdtemp(prefix="hd-"))
    logs = Path(tempfile.mkdtemp(prefix="hd-logs-"))
    try:
        yield folder, logs
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(logs, ignore_errors=True)


class Runs:
    """The successive runs on one config: :meth:`start` a new one (the previous one must be gone), and in the
    end (``finally``) :meth:`close` kills whatever still runs."""

    def __init__(self, config: Path, logs: Path) -> None:
        self.config = config
        self.logs = logs
        self.all: list[Run] = []

    @property
    def current(self) -> Run:
        return self.all[-1]

    def start(self) -> Run:
        assert not self.all or not self.current.alive(), "the previous run still runs"
        run = Run(self.config, self.logs / f"run-{len(self.all)}.log")
        self.all.append(run)
        return run.start()

    def close(self) -> None:
        for run in self.all:
            if getattr(run, "proc", None) is not None and run.alive():
                run.kill()


def stored_tokens(folder: Path) -> dict[str, tuple[int, ...]]:
    """Every agent's conversation tokens as the agents' store holds them now (read-only: SQLite's WAL lets a reader
    in beside the running daemon's writer)."""
    db = sqlite3.connect(f"file:{folder / store.FILE_NAME}?mode=ro", uri=True, timeout=HUNG_S)
    try:
        return {row[0]: store.unpack_tokens(row[1]) for row in db.execute("SELECT id, tokens FROM agents")}
    finally:
        db.close()
