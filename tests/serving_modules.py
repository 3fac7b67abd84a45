"""Run ``appliance run`` in this process, load a model through its socket, serve a chat over HTTP, then write what the
process imported.

``python tests/serving_modules.py CONFIG MODEL OUT``: the appliance's own ``main(["run", "--config", CONFIG])`` runs
in the main thread, as the ``appliance`` command runs it; a probe thread waits for the socket the config names, sends
``REGISTER probe MODEL`` and ``DECODE probe 2 Hello`` (so the model is loaded and has decoded), then asks the HTTP
address the config names for ``GET /v1/health`` and a ``POST /v1/chat/completions`` of 2 tokens, writes
``{"replies": [...], "http": [[status, body], ...], "modules": [...]}`` (``sorted(sys.modules)``) as JSON to OUT and
stops the process with SIGTERM. It imports nothing a serving process would not (the standard library's socket, json,
threading, and http.client, which starlette imports)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

import yaml

READY_TIMEOUT_S = 90.0
REPLY_ENDS = ("END_RESPONSE",)


def read_replies(conn: socket.socket, count: int) -> list[str]:
    """``count`` line-protocol replies; a reply ends at a first line ``ERR …`` or at ``END_RESPONSE``."""
    replies: list[str] = []
    current: list[str] = []
    buffer = b""
    while len(replies) < count:
        chunk = conn.recv(65536)
        if not chunk:
            raise ConnectionError(f"the daemon closed the connection after {len(replies)} replies")
        buffer += chunk
        while b"\n" in buffer:
            raw, buffer = buffer.split(b"\n", 1)
            line = raw.decode()
            current.append(line)
            if line in REPLY_ENDS or (len(current) == 1 and line.startswith("ERR ")):
                replies.append("\n".join(current))
                current = []
    return replies


def connect(path: Path) -> socket.socket:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(str(path))
        except OSError:
            conn.close()
            if time.monotonic() > deadline:
                raise TimeoutError(f"no daemon answered on {path} in {READY_TIMEOUT_S:.0f} s") from None
            time.sleep(0.1)
            continue
        conn.settimeout(READY_TIMEOUT_S)
        return conn


def http_exchanges(port: int, model: str) -> list[tuple[int, str]]:
    """``GET /v1/health`` and a chat completion of 2 tokens: each answer's status and body."""
    chat = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
    answers = []
    for method, path, body in (("GET", "/v1/health", None), ("POST", "/v1/chat/completions", json.dumps(chat))):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=READY_TIMEOUT_S)
        try:
            conn.request(method, path, body, {"content-type": "application/json"})
            response = conn.getresponse()
            answers.append((response.status, response.read().decode()))
        finally:
            conn.close()
    return answers


def probe(socket_path: Path, http_port: int, model: str, out: Path) -> None:
    try:
        with connect(socket_path) as conn:
            conn.sendall(f"REGISTER probe {model}\nDECODE probe 2 Hello\n".encode())
            replies = read_replies(conn, 2)
        answers = http_exchanges(http_port, model)
        out.write_text(json.dumps({"replies": replies, "http": answers, "modules": sorted(sys.modules)}))
    except Exception as exc:  # the test reads the reason from OUT
        out.write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
    os.kill(os.getpid(), signal.SIGTERM)


def main() -> int:
    config, model, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    settings = yaml.safe_load(Path(config).read_text())
    socket_path = Path(settings["socket"]["path"])
    threading.Thread(target=probe, args=(socket_path, settings["http"]["port"], model, out), daemon=True).start()
    from appliance.cli import main as appliance_main

    return appliance_main(["run", "--config", config])


if __name__ == "__main__":
    sys.exit(main())
