"""The registry file (SPEC C4): model name -> socket path, HTTP endpoint and state, under the state dir.

The daemon rewrites it (atomically, never failing a request: :mod:`appliance.daemon.statefiles`) when it starts
and whenever models change; the CLI reads it to find the daemon.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from appliance.config.validate import Config
    from appliance.daemon.core import Daemon

FILENAME = "registry.json"


def path(state_dir: Path) -> Path:
    return state_dir / FILENAME


def document(config: Config, daemon: Daemon, http_url: str | None) -> dict[str, Any]:
    socket_path = str(config.socket.path)
    models = {spec.name: {"socket": socket_path, "http": http_url, "state": daemon.model_state(spec.name),
                          "path": str(spec.path)} for spec in config.models}
    return {"schema": "appliance-registry/1", "pid": os.getpid(), "updated": time.time(),
            "socket": socket_path, "http": http_url, "models": models}


def encode(doc: dict[str, Any]) -> bytes:
    """The file's bytes; the daemon writes them through :class:`~appliance.daemon.statefiles.StateFiles`."""
    return json.dumps(doc, indent=2).encode()


def read(state_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path(state_dir).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
