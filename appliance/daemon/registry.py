"""The registry file (SPEC C4): model name -> socket path, HTTP endpoint and state, under the state dir.

The daemon rewrites it (atomically) when it starts and whenever models change; the CLI reads it to find
the daemon.
"""

from __future__ import annotations

import json
import os
import tempfile
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


def write(state_dir: Path, doc: dict[str, Any]) -> Path:
    state_dir.mkdir(parents=True, exist_ok=True)
    target = path(state_dir)
    fd, tmp = tempfile.mkstemp(dir=state_dir, prefix=".registry.", suffix=".json")
    with os.fdopen(fd, "w") as fh:
        json.dump(doc, fh, indent=2)
    os.replace(tmp, target)
    return target


def read(state_dir: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path(state_dir).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
