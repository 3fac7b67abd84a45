"""The appliance already running, measured in place (``appliance benchmark --socket``).

Each measurement's engine settings are laid over the file's with the line protocol's ``TUNE``, on one connection
that the run keeps open (a ``HELP`` now and then keeps it from the idle timeout). Closing it, at the end or when
the run dies, gives the appliance its own settings back; the session's conversations are unregistered after each
measurement. So the run leaves the appliance as it found it, and the operator's file is never written.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.benchmark.session import Served, health, warm_up
from appliance.client.lines import read_reply
from appliance.protocol.lines import Reply, parse_reply

KEEPALIVE_S = 30.0
"""A ``HELP`` this often on the held connection: well inside any sensible ``socket.idle_timeout_s``."""
SETTLE_TIMEOUT_S = 300.0
"""How long the live context may take to follow new settings (a switch waits for the model to go idle)."""


class TuneFailed(Exception):
    """The running appliance refused a measurement's settings, or did not follow them."""


@dataclass(frozen=True)
class RunningAppliance:
    """Where the running appliance answers, and its process id when the registry file names it (its memory)."""

    socket: Path
    http: str
    pid: int | None


def setting_text(value: Any) -> str:
    """A value as ``TUNE`` takes it: YAML without spaces (``false``, ``[60,30]``, ``1.2``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list | tuple):
        return "[" + ",".join(setting_text(item) for item in value) + "]"
    return str(value)


class Control:
    """The held line-protocol connection: one command at a time, a keep-alive beside them."""

    def __init__(self, path: Path, timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        self.sock.connect(str(path))
        self.stream = self.sock.makefile("r", encoding="utf-8", newline="\n")
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.keeper = threading.Thread(target=self.keep_alive, name="tune-keepalive", daemon=True)
        self.keeper.start()

    def command(self, line: str) -> Reply:
        with self.lock:
            self.sock.sendall(line.encode("utf-8") + b"\n")
            return parse_reply(read_reply(self.stream))

    def keep_alive(self) -> None:
        while not self.stop.wait(KEEPALIVE_S):
            with contextlib.suppress(OSError, ValueError):
                self.command("HELP")

    def tune(self, engine: Mapping[str, Any]) -> None:
        """Hold ``engine`` (field names) over the file's settings; the reload that applies them must succeed."""
        words = " ".join(f"engine.{name}={setting_text(value)}" for name, value in engine.items())
        reply = self.command(f"TUNE {words}".rstrip())
        if reply.error is not None:
            raise TuneFailed(f"TUNE {words}: {reply.error.code}: {reply.error.message}")
        if reply.fields.get("result") not in ("applied", "unchanged"):
            raise TuneFailed(f"TUNE {words}: the reload was {reply.fields.get('result')}: {reply.fields.get('error')}")

    def close(self) -> None:
        """Let go of every setting held (the appliance reloads its file's)."""
        self.stop.set()
        with contextlib.suppress(OSError):
            self.stream.close()
            self.sock.close()


def follows(record: Mapping[str, Any], engine: Mapping[str, Any]) -> bool:
    """Whether a live context record (``/v1/health`` ``contexts``) runs with ``engine``'s strategy and pinned
    threads: its plan is ``fixed`` exactly under the fixed strategy (its ``adaptive`` flag is the config's, and
    changes before the context is rebuilt)."""
    if "adaptive" in engine and (record.get("plan") == "fixed") is bool(engine["adaptive"]):
        return False
    pinned = engine.get("threads") or 0
    return not (pinned and record.get("threads") != pinned)


def settle(served: Served, engine: Mapping[str, Any]) -> None:
    """Wait until the model's live context runs with ``engine`` (its switch waits for the model to go idle)."""
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while True:
        records = [c for c in health(served.base_url).get("contexts", []) if c.get("model") == served.model]
        if records and all(follows(record, engine) for record in records):
            return
        if time.monotonic() > deadline:
            raise TuneFailed(f"the live context of {served.model} did not follow {dict(engine)} in "
                             f"{SETTLE_TIMEOUT_S:.0f} s")
        time.sleep(0.1)


@contextlib.contextmanager
def tuned(control: Control, target: RunningAppliance, model: str, engine: Mapping[str, Any]) -> Iterator[Served]:
    """The running appliance with ``engine`` held, its model loaded and warmed up, its context following."""
    control.tune(engine)
    served = Served(target.http, target.socket, target.pid or 0, Path(os.devnull), model)
    warm_up(served)
    settle(served, engine)
    yield served
